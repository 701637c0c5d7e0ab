"""Admin's omega folded into the weights of a plain Post-LN model (Liu et al. 2020, appendix C).

The fold step ``omega`` of :func:`.fold.plain_state_dict` (declared by Admin's and DeepNorm's residual
scalings, :class:`~fairseq_deepinit.methods.exporting.Export`), and the stock model arguments of the export
(:func:`export_args`). The derivation, per stack, for sub-layers k = 1..K in forward order, with LN_k the
norm after sub-layer k (gamma_k, beta_k)::

    Admin:     x_k  = LN_k(x_{k-1} * w_k + f_k(x_{k-1}))
    exported:  x'_k = LN'_k(x'_{k-1} + f'_k(x'_{k-1}))       with x'_{k-1} = x_{k-1} * w_k

- f'_k(y) = f_k(y / w_k): the sub-layer's input projections take 1/w_k on their input columns
  (FFN: fc1; self-attention: q, k, v; cross-attention: q only, its keys and values read the encoder
  output, which stays unscaled);
- LN'_{k-1} = w_k * LN_{k-1}: gamma_{k-1} and beta_{k-1} times w_k, so that its output is already
  the next sub-layer's scaled input; the last norm of each stack is unchanged (the encoder output
  feeds the cross-attention keys/values, the decoder output the output projection);
- the first sub-layer's input is the embedding, x_0 = embed_scale * E[token] + P[position] (then
  dropout, which commutes with the scaling). x_0 * w_1 is ``layernorm_embedding`` scaled by w_1 when
  the model has one; otherwise E's columns and the position table are scaled by w_1: sinusoidal
  positions become a learned table (sinusoid * w_1, ``--*-learned-pos``), since a fixed sinusoid
  cannot carry a per-dimension scale. When the decoder's output projection is tied to its scaled
  embedding, the decoder's last norm is divided by w_1 (logits = E (w_1 * x / w_1)); when encoder
  and decoder shared one embedding but their w_1 differ, the export un-shares them. Nothing changes
  where w_1 = 1 exactly (the default start of the recurrence, kept when omega is frozen).

The fold is computed in float64 and written in float32.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

import torch

from .. import options
from ..errors import AdminExportError
from .fairseq_args import FairseqArgs

SUBLAYER_NORMS = {
    "self_attn": "self_attn_layer_norm",
    "encoder_attn": "encoder_attn_layer_norm",
    "ffn": "final_layer_norm",
}
SUBLAYER_INPUTS = {
    ("encoder", "self_attn"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("encoder", "ffn"): ("fc1",),
    ("decoder", "self_attn"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("decoder", "encoder_attn"): ("encoder_attn.q_proj",),
    ("decoder", "ffn"): ("fc1",),
}


def _deepinit_option_names() -> set:
    """Every option the deepinit model adds to fairseq's parser (dropped from the exported args)."""
    return {option.name for option, _method in options.all_options()}


def _omega_groups(sd: Dict[str, torch.Tensor]) -> Dict[str, List[Tuple[str, str]]]:
    """Per stack, ``(layer prefix, sub-layer)`` in forward order, read from the omega keys."""
    found: Dict[str, Dict[int, List[str]]] = {"encoder": {}, "decoder": {}}
    for key in sd:
        if key.endswith(".omega") and ".residuals." in key:
            prefix, sub = key[: -len(".omega")].split(".residuals.")
            stack, _, idx = prefix.split(".")
            found[stack].setdefault(int(idx), []).append(sub)
    order = {"encoder": ("self_attn", "ffn"), "decoder": ("self_attn", "encoder_attn", "ffn")}
    out = {}
    for stack, layers in found.items():
        out[stack] = [(f"{stack}.layers.{i}", sub) for i in sorted(layers) for sub in order[stack] if sub in layers[i]]
    return out


def fold_state_dict(
    sd: Dict[str, torch.Tensor], args, dtype: torch.dtype = torch.float32
) -> Tuple[Dict[str, torch.Tensor], dict]:
    """The plain Post-LN state dict (floating tensors in ``dtype``) and the argument changes.

    See the module docstring for the derivation; the arithmetic is done in float64.
    """
    sd = {k: v.detach().to(torch.float64).clone() if v.is_floating_point() else v.clone() for k, v in sd.items()}
    changes: dict = {}
    groups = _omega_groups(sd)
    pad = 1  # fairseq's Dictionary: <s>=0, <pad>=1

    def omega(prefix: str, sub: str) -> torch.Tensor:
        w = sd[f"{prefix}.residuals.{sub}.omega"]
        if not torch.isfinite(w).all() or (w == 0).any():
            raise AdminExportError(f"omega of {prefix}.{sub} has zero or non-finite entries; it cannot be folded")
        return w

    first = {}
    for stack, subs in groups.items():
        for k, (prefix, sub) in enumerate(subs):
            w = omega(prefix, sub)
            for proj in SUBLAYER_INPUTS[(stack, sub)]:
                sd[f"{prefix}.{proj}.weight"] = sd[f"{prefix}.{proj}.weight"] / w[None, :]
            if k == 0:
                first[stack] = w
            else:
                prev_prefix, prev_sub = subs[k - 1]
                for p in ("weight", "bias"):  # an RMS norm has no bias
                    key = f"{prev_prefix}.{SUBLAYER_NORMS[prev_sub]}.{p}"
                    if key in sd:
                        sd[key] = sd[key] * w

    # the embeddings carry the first sub-layer's omega
    fs = FairseqArgs.of(args)
    ln_emb = bool(fs.layernorm_embedding)
    shared = bool(fs.share_all_embeddings)  # absent for a language model
    tied = bool(args.share_decoder_input_output_embed or shared)
    unshare = shared and not ln_emb and not torch.equal(first["encoder"], first["decoder"])
    if unshare:
        changes.update(share_all_embeddings=False, share_decoder_input_output_embed=True)
    for stack, w in first.items():
        if ln_emb:
            for p in ("weight", "bias"):
                key = f"{stack}.layernorm_embedding.{p}"
                if key in sd:
                    sd[key] = sd[key] * w
            continue
        if bool((w == 1).all()):
            continue
        emb_key = f"{stack}.embed_tokens.weight"
        sd[emb_key] = sd[emb_key] * w[None, :]
        if not fs.no_token_positional_embeddings:
            pos_key = f"{stack}.embed_positions.weight"
            if fs.learned_pos(stack):
                sd[pos_key] = sd[pos_key] * w[None, :]
            else:
                from fairseq.modules import SinusoidalPositionalEmbedding

                max_pos = args.max_source_positions if stack == "encoder" else args.max_target_positions
                table = SinusoidalPositionalEmbedding.get_embedding(max_pos + pad + 1, w.numel(), pad)
                sd[pos_key] = table.to(torch.float64) * w[None, :]
                changes[f"{stack}_learned_pos"] = True
        if stack == "decoder" and tied:
            sd["decoder.output_projection.weight"] = sd[emb_key]
            last_prefix, last_sub = groups["decoder"][-1]
            for p in ("weight", "bias"):
                key = f"{last_prefix}.{SUBLAYER_NORMS[last_sub]}.{p}"
                if key in sd:
                    sd[key] = sd[key] / w
    if shared and not unshare:
        # one embedding for both stacks, scaled by the same omega_1 (or not at all)
        sd["decoder.embed_tokens.weight"] = sd["encoder.embed_tokens.weight"]
        sd["decoder.output_projection.weight"] = sd["encoder.embed_tokens.weight"]

    out = {k: v for k, v in sd.items() if ".residuals." not in k}  # omega and the profiled flags
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}, changes


def export_args(args, changes: dict) -> dict:
    """Plain, fairseq-``transformer`` model arguments (a dict of primitives, no Namespace)."""
    drop = _deepinit_option_names()
    out = {}
    for key, value in vars(args).items():
        if key in drop or key.startswith("_"):
            continue
        if isinstance(value, tuple):
            value = list(value)
        if not (value is None or isinstance(value, (str, int, float, bool, list, dict))):
            value = str(value)
        out[key] = value
    out.update(changes)
    out.update(_name="transformer", arch="transformer", task="translation", user_dir=None)
    out["checkpoint_activations"] = False
    out["offload_activations"] = False
    return out


def _primitive(obj):
    if isinstance(obj, argparse.Namespace):
        return _primitive(vars(obj))
    if isinstance(obj, dict):
        return {k: _primitive(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_primitive(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if torch.is_tensor(obj):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    return str(obj)
