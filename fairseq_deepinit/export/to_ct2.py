"""``--to ctranslate2``: the plain weights (:mod:`.fold`) in CTranslate2's own spec classes.

The spec is built as CTranslate2's fairseq converter builds a stock model's (ctranslate2 4.8.5
``python/ctranslate2/converters/fairseq.py:207-301``: fused q/k/v of a self-attention and fused k/v of a
cross-attention, ``<pad>`` as ``<blank>`` in the vocabularies, the decoder started by ``</s>``, ``</s>``
added to each source, the position table from its row ``padding_idx + 1``), with the fields the converter
leaves at their defaults set from the route (:class:`.route.Route`; file:line in docs/export.md):

- ``pre_norm`` per stack (``specs/transformer_spec.py:15,122``), Post-LN or Pre-LN;
- Peri-LN as ``pre_post_layer_norm`` (``transformer_spec.py:330-343,414-438``) with the decoder's
  cross-attention norms ``external_pre_post_encoder_layers`` (its norms around the attention, not a
  residual inside it: ``src/layers/transformer.cc:253-279``);
- RMSNorm, ScaleNorm (an RMSNorm, :mod:`.fold`) and the norm-free families (an RMSNorm that is the
  identity, :data:`.route.IDENTITY_EPS`) as ``rms_norm``; the one epsilon as ``layer_norm_epsilon``;
- q/k norms of the self-attentions as its per-head ``q_norm`` / ``k_norm`` (``attention_spec.py:115-117``);
- a gated FFN (plain SwiGLU, :mod:`fairseq_deepinit.modules.glu`) as ``ffn_glu`` with activation SWISH
  (``transformer_spec.py:443-449``: ``linear_0`` the activated half, the gate ``W_g``; ``linear_0_noact`` ``fc1``);
- the decoder's output soft-cap ``c tanh(z / c)`` as ``final_logit_softcapping`` (``transformer_spec.py:276``);
- ``scale_embeddings`` as the model's ``embed_scale`` (1 with ``--no-scale-embedding``), the output
  projection's bias (FixNorm's), ``project_in`` / ``project_out``, ``layernorm_embedding``.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from .route import CT2_ACTIVATIONS, IDENTITY_GAIN, Route

ATTENTION_NORMS = {"self_attn": "self_attn_layer_norm", "encoder_attn": "encoder_attn_layer_norm"}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def vocabulary(dictionary) -> List[str]:
    """A fairseq dictionary's symbols with ``<pad>`` as ``<blank>`` (converters/fairseq.py:100-101)."""
    return ["<blank>" if token == "<pad>" else token for token in dictionary.symbols]


class _Writer:
    """Sets the spec's variables from the plain state dict ``sd``."""

    def __init__(self, sd: Dict[str, torch.Tensor], route: Route) -> None:
        self.sd = sd
        self.route = route

    def linear(self, spec, prefix: str) -> None:
        spec.weight = _np(self.sd[f"{prefix}.weight"])
        if f"{prefix}.bias" in self.sd:
            spec.bias = _np(self.sd[f"{prefix}.bias"])

    def fused(self, spec, prefixes: List[str]) -> None:
        spec.weight = np.concatenate([_np(self.sd[f"{p}.weight"]) for p in prefixes])
        spec.bias = np.concatenate([_np(self.sd[f"{p}.bias"]) for p in prefixes])

    def norm(self, spec, prefix: str, dim: int) -> None:
        """A norm: LayerNorm gain and bias, RMSNorm gain, or the identity RMSNorm where the model has none."""
        if self.route.norm == "none":
            spec.gamma = np.full((dim,), IDENTITY_GAIN, dtype=np.float32)
            return
        spec.gamma = _np(self.sd[f"{prefix}.weight"])
        if hasattr(spec, "beta"):
            spec.beta = _np(self.sd[f"{prefix}.bias"])

    def attention(self, spec, prefix: str, self_attention: bool) -> None:
        if self_attention:
            self.fused(spec.linear[0], [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        else:
            self.linear(spec.linear[0], f"{prefix}.q_proj")
            self.fused(spec.linear[1], [f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.linear(spec.linear[-1], f"{prefix}.out_proj")
        if hasattr(spec, "q_norm"):
            for which in ("q", "k"):
                norm = getattr(spec, f"{which}_norm")
                norm.gamma = _np(self.sd[f"{prefix}.{which}_proj.norm.weight"])
                if hasattr(norm, "beta"):
                    norm.beta = _np(self.sd[f"{prefix}.{which}_proj.norm.bias"])

    def layer(self, spec, prefix: str, dim: int, placement: str, cross: bool) -> None:
        self.attention(spec.self_attention, f"{prefix}.self_attn", True)
        if cross:
            self.attention(spec.attention, f"{prefix}.encoder_attn", False)
        if hasattr(spec.ffn, "linear_0_noact"):  # a gated FFN: silu(W_g x) * fc1(x)
            self.linear(spec.ffn.linear_0, f"{prefix}.ffn_gate.proj")
            self.linear(spec.ffn.linear_0_noact, f"{prefix}.fc1")
        else:
            self.linear(spec.ffn.linear_0, f"{prefix}.fc1")
        self.linear(spec.ffn.linear_1, f"{prefix}.fc2")
        if placement != "peri":
            self.norm(spec.self_attention.layer_norm, f"{prefix}.self_attn_layer_norm", dim)
            if cross:
                self.norm(spec.attention.layer_norm, f"{prefix}.encoder_attn_layer_norm", dim)
            self.norm(spec.ffn.layer_norm, f"{prefix}.final_layer_norm", dim)
            return
        self.norm(spec.input_layer_norm, f"{prefix}.self_attn_layer_norm", dim)
        self.norm(spec.post_attention_layer_norm, f"{prefix}.self_attn_out_norm", dim)
        if cross:
            self.norm(spec.external_pre_encoder_attention_layer_norm, f"{prefix}.encoder_attn_layer_norm", dim)
            self.norm(spec.external_post_encoder_attention_layer_norm, f"{prefix}.encoder_attn_out_norm", dim)
        self.norm(spec.pre_feedforward_layer_norm, f"{prefix}.final_layer_norm", dim)
        self.norm(spec.post_feedforward_layer_norm, f"{prefix}.ffn_out_norm", dim)

    def inputs(self, spec, stack: str, facts: dict) -> None:
        embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
        embeddings.weight = _np(self.sd[f"{stack}.embed_tokens.weight"])
        spec.scale_embeddings = float(facts["embed_scale"])
        # a table of the fold's (Admin's omega on sinusoidal positions makes them learned), else the model's
        table = self.sd.get(f"{stack}.embed_positions.weight", facts["positions"])
        spec.position_encodings.encodings = _np(table[facts["padding_idx"] + 1 :])
        if hasattr(spec, "layernorm_embedding"):
            self.norm(spec.layernorm_embedding, f"{stack}.layernorm_embedding", facts["dim"])
        if hasattr(spec, "layer_norm"):
            self.norm(spec.layer_norm, f"{stack}.layer_norm", facts["dim"])


def _stack_spec(route: Route, stack: str, facts: dict):
    from ctranslate2.specs import common_spec, transformer_spec

    placement = route.placements[stack]
    activation = "SWISH" if facts["glu"] else CT2_ACTIVATIONS[route.activation]  # the gate's silu is Swish_1
    kwargs = dict(
        pre_norm=placement != "post",
        activation=getattr(common_spec.Activation, activation),
        ffn_glu=facts["glu"],
        layernorm_embedding=facts["layernorm_embedding"],
        rms_norm=route.norm != "layernorm",
        qk_norm=route.qk_norm is not None,
        pre_post_layer_norm=placement == "peri",
    )
    if stack == "encoder":
        spec = transformer_spec.TransformerEncoderSpec(
            facts["layers"], facts["heads"], no_final_norm=not facts["final_norm"], **kwargs
        )
    else:
        spec = transformer_spec.TransformerDecoderSpec(
            facts["layers"],
            facts["heads"],
            with_encoder_attention=not route.lm,
            no_final_norm=not facts["final_norm"],
            project_in_out=facts["project_in_out"],
            external_pre_post_encoder_layers=placement == "peri" and not route.lm,
            **kwargs,
        )
    for layer in spec.layer:
        if route.qk_norm is not None and route.qk_norm.kind == "layernorm":
            layer.self_attention.q_norm = common_spec.LayerNormSpec(rms_norm=False)
            layer.self_attention.k_norm = common_spec.LayerNormSpec(rms_norm=False)
        cross = getattr(layer, "attention", None)
        if cross is not None and hasattr(cross, "q_norm"):  # self-attention only (the route refused the rest)
            del cross.q_norm, cross.k_norm
    return spec


def build_spec(sd: Dict[str, torch.Tensor], route: Route, facts: Dict[str, dict], vocabularies: List[List[str]]):
    """The CTranslate2 ``TransformerSpec`` (translation) or ``TransformerDecoderModelSpec`` (language model).

    ``facts``: per stack, what the state dict does not say (:func:`stack_facts`); ``vocabularies``: the
    source and target vocabularies (:func:`vocabulary`; one for a language model).
    """
    from ctranslate2.specs import transformer_spec

    writer = _Writer(sd, route)
    specs = {}
    for stack, f in facts.items():
        spec = _stack_spec(route, stack, f)
        writer.inputs(spec, stack, f)
        placement = route.placements[stack]
        for i, layer in enumerate(spec.layer):
            writer.layer(layer, f"{stack}.layers.{i}", f["dim"], placement, cross=stack == "decoder" and not route.lm)
        specs[stack] = spec
    dec = specs["decoder"]
    writer.linear(dec.projection, "decoder.output_projection")
    if facts["decoder"]["final_logit_cap"] is not None:
        dec.final_logit_softcapping = np.float32(facts["decoder"]["final_logit_cap"])
    if facts["decoder"]["project_in_out"]:
        writer.linear(dec.project_in, "decoder.project_in_dim")
        writer.linear(dec.project_out, "decoder.project_out_dim")
    if route.lm:
        model = transformer_spec.TransformerDecoderModelSpec(dec)
        model.register_vocabulary(vocabularies[0])
        if not facts["decoder"]["add_bos_token"]:
            model.config.bos_token = model.config.eos_token  # as CTranslate2's converter (fairseq.py:189-190)
    else:
        model = transformer_spec.TransformerSpec(specs["encoder"], dec)
        model.register_source_vocabulary(vocabularies[0])
        model.register_target_vocabulary(vocabularies[1])
        model.config.decoder_start_token = model.config.eos_token  # fairseq starts the decoder with </s>
        model.config.add_source_eos = True  # fairseq's sources end with </s> (converters/fairseq.py:201-202)
    model.config.layer_norm_epsilon = route.ct2_eps
    return model


def stack_facts(model, args, route: Route) -> Dict[str, dict]:
    """Per stack of the (plugin) ``model``: depth, heads, width, embedding scale, position table, which
    optional norms and projections it has, whether its FFNs are gated, the decoder's output soft-cap."""
    from fairseq.modules import SinusoidalPositionalEmbedding

    out = {}
    for stack in route.placements:
        module = getattr(model, stack)
        dim = module.embed_tokens.embedding_dim if stack == "encoder" else module.embed_dim
        positions = module.embed_positions
        table = positions.weights if isinstance(positions, SinusoidalPositionalEmbedding) else positions.weight
        out[stack] = dict(
            layers=len(module.layers),
            heads=int(getattr(args, f"{stack}_attention_heads")),
            dim=dim,
            embed_scale=float(module.embed_scale),
            positions=table.detach(),
            padding_idx=module.padding_idx,
            layernorm_embedding=getattr(module, "layernorm_embedding", None) is not None,
            final_norm=getattr(module, "layer_norm", None) is not None,
            project_in_out=getattr(module, "project_in_dim", None) is not None,
            add_bos_token=bool(getattr(args, "add_bos_token", False)),
            glu=any(getattr(layer, "ffn_gate", None) is not None for layer in module.layers),
            final_logit_cap=getattr(module, "final_logit_cap", None),
        )
    return out
