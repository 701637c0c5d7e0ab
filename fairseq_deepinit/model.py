"""The ``deepinit`` fairseq model: fairseq's TransformerModel with four independent axes.

- norm position per stack: fairseq's ``--encoder-normalize-before`` / ``--decoder-normalize-before``
  (Post-LN "v1" when off, Pre-LN "v2"/T2T when on; Xu et al. 2020 eq. 1-2), or ``--norm-placement``
  (also Peri-LN's and OLMo 2's placements, :mod:`fairseq_deepinit.methods.placement`), a value per layer;
- norm type: ``--norm-type`` (:mod:`fairseq_deepinit.modules.norms`), plus ``--fixnorm`` embeddings;
- residual scaling: ``--residual-scale`` (:mod:`fairseq_deepinit.modules.residual`);
- init scheme: ``--init-scheme``, applied once after building;

each value contributed by a method's record, resolved once into the model's
:class:`~fairseq_deepinit.spec.ModelSpec`, which the build hooks read through :mod:`fairseq_deepinit.plan`.

Everything is built through fairseq's extension points (``build_embedding``,
``build_encoder``/``build_decoder``, ``build_*_layer``, ``build_output_projection``); the layers have
their own explicit forward (:mod:`fairseq_deepinit.modules.layers`). The stacks' forwards are fairseq's,
except for one step in each stack, where fairseq makes the host read device data (a GPU sync) on every
call; they are the one place where a stack loops over its layers:

- the encoder's ``forward_scriptable`` re-reads ``has_pads`` (a device tensor) once per layer
  (fairseq ``transformer_encoder.py:205-216, 229-232``): :meth:`DeepInitEncoder.forward_scriptable`
  gives every layer the padding mask instead, as fairseq itself does on XLA for the same reason;
- the decoder's ``extract_features_scriptable`` reads ``prev_output_tokens.eq(pad).any()`` on every
  call (``transformer_decoder.py:327-329``): :meth:`DeepInitDecoder.extract_features_scriptable`
  decides from the padding side of the targets, a build-time property (:mod:`.modules.padding`).

Each replacement is fairseq's method with only those lines changed; the values every real (non-pad)
position gets, the loss and the gradients are fairseq's. A stack's second stream (``dual_stream``, ResiDual:
:mod:`.modules.dual_stream`) starts at its embedding output, goes through every layer call and its ``layer_norm``.
"""

from __future__ import annotations

import logging
from typing import Dict, List

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from torch import Tensor

from . import model_config, options, plan, resolve
from .checkpoints import config_check
from .modules.attention import declare_target_padding
from .modules.dual_stream import DualStream
from .modules.fixnorm import FixNormOutputProjection
from .modules.layers import DeepInitEncoderLayer
from .modules.masks import future_mask
from .modules.padding import target_padding
from .modules.stacks import ENCODER, decoder_kind
from .training import distributed
from .training.activation_checkpoint import checkpoint_wrapper

logger = logging.getLogger(__name__)

MODEL_NAME = config_check.TRANSLATION_MODEL


def _wrap_layer(cfg, layer):
    """fairseq's activation-checkpoint / FSDP wrapping of a freshly built layer (fairseq's
    ``TransformerEncoderBase.build_encoder_layer``), with the checkpoint's recompute under the forward's
    autocast state (:mod:`.training.activation_checkpoint`)."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


def _replace_stack_norms(module, spec, embed_dim: int) -> None:
    """Swap the stack-level norms fairseq built (final Pre-LN norm, at position ``final``; embedding norm)."""
    for attr, position in (("layer_norm", "final"), ("layernorm_embedding", None)):
        if getattr(module, attr, None) is not None:
            setattr(module, attr, plan.build_stack_norm(spec, embed_dim, position))


def _keep_version(module, state_dict, name: str) -> None:
    """Read a state dict without ``<name>.version`` as one of this version, not as a pre-2019 one.

    fairseq takes a missing key for version 1 and then removes the stack's final norm
    (fairseq/models/transformer/transformer_encoder.py:340-345, transformer_decoder.py:430-435). Every
    checkpoint of this plugin has the key, but fairseq's EMA loads its averages without it (it skips
    "version" keys, fairseq/models/ema/ema.py:164-174), which removed the EMA model's final Pre-LN norm
    (and left its weights out of the EMA) without a word.
    """
    state_dict.setdefault(f"{name}.version", module.version.detach().clone())


class DeepInitEncoder(TransformerEncoderBase):
    dual_stream: DualStream | None = None  # a second stream beside the layers' (ResiDual), set up by a method

    def __init__(self, cfg, dictionary, embed_tokens, return_fc: bool = False) -> None:
        self._built_layers, self._spec = 0, plan.spec_of(cfg)
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        _replace_stack_norms(self, self._spec, embed_tokens.embedding_dim)
        plan.setup_stack(self, self._spec, ENCODER)

    def build_encoder_layer(self, cfg):
        self._built_layers += 1
        layer_plan = plan.layer_plan(self._spec, ENCODER, self._built_layers)
        return _wrap_layer(cfg, DeepInitEncoderLayer(cfg, layer_plan, return_fc=self.return_fc))

    def upgrade_state_dict_named(self, state_dict, name):
        _keep_version(self, state_dict, name)
        return super().upgrade_state_dict_named(state_dict, name)

    def forward_scriptable(
        self,
        src_tokens: Tensor,
        src_lengths: Tensor | None = None,
        return_all_hiddens: bool = False,
        token_embeddings: Tensor | None = None,
    ) -> Dict[str, List[Tensor]]:
        """fairseq's ``TransformerEncoderBase.forward_scriptable`` (transformer_encoder.py:173-266) with
        the padding mask given to every layer, without reading ``has_pads`` on the host.

        fairseq computes ``has_pads = encoder_padding_mask.any()`` (lines 205-210), multiplies the
        embeddings by ``1 - mask * has_pads`` (214-217) and passes ``mask if has_pads else None`` to
        each layer (229-232): a device-to-host read per layer, which also cuts ``torch.compile``'s
        graph at every layer. Here every layer gets the mask, as fairseq does on XLA (its
        ``has_pads`` is forced true there, line 206). An all-false mask changes no value: attention
        masks nothing, and ``x * (1 - mask)`` multiplies by one. ResiDual's second stream: microsoft/ResiDual
        @ 8682f75 ``resi_dual/resi_dual.py:107-131`` (``encoder_states`` are the layers' ``x``, as there).
        """
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        # account for padding while computing the representation
        x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        encoder_states: List[Tensor] = []
        fc_results: List[Tensor | None] = []
        if return_all_hiddens:
            encoder_states.append(x)
        raw = None if self.dual_stream is None else self.dual_stream.begin(x)
        for layer in self.layers:
            if raw is not None:
                x, raw, fc_result = layer(x, encoder_padding_mask=encoder_padding_mask, raw=raw)
            else:
                lr = layer(x, encoder_padding_mask=encoder_padding_mask)
                if isinstance(lr, tuple) and len(lr) == 2:
                    x, fc_result = lr
                else:
                    x, fc_result = lr, None
            if return_all_hiddens:
                encoder_states.append(x)
                fc_results.append(fc_result)
        if raw is not None:
            x = self.dual_stream.close(x, raw, self.layer_norm)
        elif self.layer_norm is not None:
            x = self.layer_norm(x)

        src_lengths = src_tokens.ne(self.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "encoder_states": encoder_states,  # List[T x B x C]
            "fc_results": fc_results,  # List[T x B x C]
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }


class DeepInitDecoder(TransformerDecoderBase):
    """fairseq's decoder with the plugin's layers, norms and output projection.

    ``target_padding``: where the task pads the decoder's input (``right``, ``left``, ``unknown``;
    :func:`~fairseq_deepinit.modules.padding.target_padding`, set by the model's ``build_model``):
    right-padded, its causal self-attention needs no key padding mask (:meth:`self_attn_padding_mask`)
    and its SDPA self-attentions pass ``is_causal``
    (:func:`~fairseq_deepinit.modules.attention.declare_target_padding`).
    """

    target_padding = "unknown"
    dual_stream: DualStream | None = None  # a second stream beside the layers' (ResiDual), set up by a method

    def set_target_padding(self, side: str) -> None:
        """Record where the task pads the decoder's input (a build-time fact: no forward reads the tokens)."""
        self.target_padding = side
        declare_target_padding(self, side)

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn: bool = False, output_projection=None) -> None:
        self._built_layers, self._spec = 0, plan.spec_of(cfg)
        super().__init__(
            cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn, output_projection=output_projection
        )
        _replace_stack_norms(self, self._spec, self.embed_dim)
        plan.setup_stack(self, self._spec, decoder_kind(cross_attention=not no_encoder_attn))

    def build_decoder_layer(self, cfg, no_encoder_attn: bool = False):
        self._built_layers += 1
        layer_plan = plan.layer_plan(self._spec, decoder_kind(cross_attention=not no_encoder_attn), self._built_layers)
        layer_cls = plan.decoder_layer_class(self._spec)
        return _wrap_layer(cfg, layer_cls(cfg, layer_plan, no_encoder_attn=no_encoder_attn))

    def buffered_future_mask(self, tensor):
        """fairseq's cached ``triu(-inf, 1)`` (transformer_decoder.py, ``buffered_future_mask``), built by
        :func:`~fairseq_deepinit.modules.masks.future_mask` in ``tensor``'s dtype and device, so that
        the SDPA attention knows it is the causal mask without reading it back (a device sync)."""
        dim = tensor.size(0)
        mask = self._future_mask
        if mask.size(0) < dim or mask.device != tensor.device or mask.dtype != tensor.dtype:
            self._future_mask = mask = future_mask(dim, tensor)
        return mask[:dim, :dim]

    def self_attn_padding_mask(self, prev_output_tokens: Tensor, causal: bool, mask_padding: bool) -> Tensor | None:
        """The key padding mask of the self-attention, decided without reading the tokens on the host.

        fairseq (transformer_decoder.py:327-329) passes ``prev_output_tokens.eq(pad)`` when
        ``.any()`` of it is true (a device-to-host read on every call) or under
        ``--cross-self-attention``. Under causal self-attention with right-padded targets no real
        position can see a padded one (every pad comes after it), so no mask is needed: the values
        of real positions, the loss and the gradients are fairseq's; only padded positions, which
        nothing reads, attend to earlier pads too. Otherwise (left padding, full-context
        alignment, cross-self attention, ``mask_padding``) the mask is always passed: an all-false
        one changes no value.
        """
        if self.cross_self_attention or mask_padding or not (causal and self.target_padding == "right"):
            return prev_output_tokens.eq(self.padding_idx)
        return None

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Dict[str, List[Tensor]] | None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        full_context_alignment: bool = False,
        alignment_layer: int | None = None,
        alignment_heads: int | None = None,
        mask_padding: bool = False,
    ):
        """fairseq's ``extract_features``; ``mask_padding``: mask padded targets in the self-attention
        even where real positions never see them (so that padded positions get fairseq's values too:
        Admin profiling takes statistics over every position, padding included, as its released code)."""
        return self.extract_features_scriptable(
            prev_output_tokens,
            encoder_out,
            incremental_state,
            full_context_alignment,
            alignment_layer,
            alignment_heads,
            mask_padding,
        )

    def extract_features_scriptable(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Dict[str, List[Tensor]] | None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        full_context_alignment: bool = False,
        alignment_layer: int | None = None,
        alignment_heads: int | None = None,
        mask_padding: bool = False,
    ):
        """fairseq's ``TransformerDecoderBase.extract_features_scriptable`` (transformer_decoder.py:254-370)
        with its self-attention padding mask from :meth:`self_attn_padding_mask` (lines 327-329 read it
        on the host on every call). Returns ``(features (B x T x C), {"attn": [...], "inner_states": [...]})``.
        ResiDual's second stream (``resi_dual.py:252-283``) starts at this call's embedding output: per position,
        read by no attention, so an incremental step needs nothing of it cached.
        """
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1

        enc: Tensor | None = None
        padding_mask: Tensor | None = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        # embed positions
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]

        # Prevent torchscript exporting issue for dynamic quant embedding
        prev_output_tokens = prev_output_tokens.contiguous()
        # embed tokens and positions
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x += positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        # incremental decoding is causal too (each step sees the steps before it)
        causal = incremental_state is not None or not full_context_alignment
        self_attn_padding_mask = self.self_attn_padding_mask(prev_output_tokens, causal, mask_padding)

        # decoder layers
        attn: Tensor | None = None
        inner_states: List[Tensor | None] = [x]
        raw = None if self.dual_stream is None else self.dual_stream.begin(x)
        for idx, layer in enumerate(self.layers):
            if incremental_state is None and not full_context_alignment:
                self_attn_mask = self.buffered_future_mask(x)
            else:
                self_attn_mask = None
            masks = dict(self_attn_mask=self_attn_mask, self_attn_padding_mask=self_attn_padding_mask)
            heads = dict(need_attn=bool(idx == alignment_layer), need_head_weights=bool(idx == alignment_layer))
            if raw is not None:
                x, layer_attn, _, raw = layer(x, enc, padding_mask, incremental_state, **masks, **heads, raw=raw)
            else:
                x, layer_attn, _ = layer(x, enc, padding_mask, incremental_state, **masks, **heads)
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)

        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:alignment_heads]
            # average probabilities over heads
            attn = attn.mean(dim=0)
        if raw is not None:
            x = self.dual_stream.close(x, raw, self.layer_norm)
        elif self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)  # T x B x C -> B x T x C
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        self.output_projection = plan.build_output_projection(self._spec, embed_tokens)
        if self.output_projection is None:
            super().build_output_projection(cfg, dictionary, embed_tokens)

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq's upgrade, with the version kept (:func:`_keep_version`), minus its pre-0.10 fix-up where it
        does not apply to FixNorm.

        fairseq copies ``embed_tokens.weight`` into ``output_projection.weight`` whenever that key
        is missing, for checkpoints written before the output projection was a module. The FixNorm
        projection has no weight of its own (it scores against the embedding it holds, stored as
        ``output_projection.embedding.weight``), so that copy would be an unexpected key under
        strict loading; it is dropped again here, and only when fairseq itself added it.
        """
        _keep_version(self, state_dict, name)
        key = f"{name}.output_projection.weight"
        had_key = key in state_dict
        state_dict = super().upgrade_state_dict_named(state_dict, name)
        if isinstance(self.output_projection, FixNormOutputProjection) and not had_key:
            state_dict.pop(key, None)
        return state_dict


@register_model(MODEL_NAME)
class DeepInitTransformerModel(TransformerModel):
    """fairseq's ``transformer`` with composable deep-Transformer schemes (see the README)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        options.add_model_args(parser)
        config_check.add_args(parser)  # --allow-config-change

    @classmethod
    def build_model(cls, args, task):
        cfg, args = args, model_config.as_namespace(args, task)  # fairseq-hydra-train's DictConfig: a Namespace
        distributed.check_ddp_backend(args)  # before any model work (fairseq-hydra-train, scripts)
        spec = options.resolve_and_validate(args)
        with plan.carried(args, spec):
            model = super().build_model(args, task)
        model.decoder.set_target_padding(target_padding(task))  # the task that batches the data
        plan.apply_init(model, spec)
        model.spec = spec
        model_config.keep_resolved(cfg, args)
        logger.info(resolve.describe(spec))
        return model

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        embedding = plan.build_embedding(plan.spec_of(args), dictionary, embed_dim, path)
        return embedding if embedding is not None else super().build_embedding(args, dictionary, embed_dim, path)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return DeepInitEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return DeepInitDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


model_config.register(MODEL_NAME, model_config.DeepInitConfig)  # fairseq-hydra-train (model_config.py)
