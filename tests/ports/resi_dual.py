"""ResiDual (Xie et al. 2023): a Post-LN stream plus a raw (un-normalised) stream, summed at the end.

Released code: microsoft/ResiDual (commit 8682f75), itself a fairseq user-dir plugin:

- encoder layer ``resi_dual/resi_dual_layers.py:25-51``: for each sub-layer ``F`` (self-attention, FFN),
  with ``F``'s output after dropout ``f = dropout(F(x))``::

      res = res + f * enc_res_input_norm_scale        # raw stream (37, 50)
      x   = LayerNorm(x + f)                          # Post-LN stream (39, 51)

  the same dropped-out ``f`` feeds both streams (one dropout mask);
- decoder layer ``resi_dual_layers.py:116-177``: the same rule for self-attention (``135-136``),
  cross-attention (``163-164``) and FFN (``176-177``) with ``dec_res_input_norm_scale``;
- the raw stream starts from the embedding output (after ``embed_scale``, positions, optional
  ``layernorm_embedding`` and dropout; encoder padding zeroed first): ``res = x * enc_res_input_norm_scale``
  (``resi_dual/resi_dual.py:107``, decoder ``252``; the alternative ``torch.zeros_like(x)`` is left in a
  comment there);
- the stack output is ``x * enc_alpha + layer_norm(res)`` (``resi_dual.py:131``, decoder ``283``) with
  ``layer_norm = LayerNorm(embed_dim, eps=1e-7)`` (``24``, ``157``), replacing fairseq's final norm;
- defaults (``ResiDualConfig``, ``294-300``): ``enc_alpha = dec_alpha = 1.0``,
  ``enc_res_input_norm_scale = dec_res_input_norm_scale = 1.0``; ``hydra_config/opus.yaml:25-26`` sets both
  scales to ``0.05`` for the 18+18-layer fp16 run (``common.fp16: true``, ``memory_efficient_fp16``,
  ``fp16_init_scale: 8``); ``iwslt.yaml`` keeps 1.0, ``wmt.yaml`` leaves the default.

Because ``LayerNorm(s * d) = LayerNorm(d)`` up to eps, the scale ``s`` changes only the raw stream's
magnitude (fp16 range), not the model's function: :func:`stack_output` is invariant to ``s`` up to the
eps term, ``(d - mean) / sqrt(var(d) + eps / s**2)``.
"""

from __future__ import annotations

from torch import Tensor

from .common import AttnWeights, FFNWeights, Norm, NormSpec, attention, ffn

FINAL_LN_EPS = 1e-7  # resi_dual.py:24, 157
DEFAULT_RES_SCALE = 1.0  # ResiDualConfig, resi_dual.py:299-300
OPUS_RES_SCALE = 0.05  # hydra_config/opus.yaml:25-26


def final_layer_norm(weight: Tensor | None = None, bias: Tensor | None = None) -> NormSpec:
    return NormSpec("layer", weight, bias, FINAL_LN_EPS)


def stack_start(x0: Tensor, scale: float = DEFAULT_RES_SCALE) -> tuple[Tensor, Tensor]:
    """``(x, res)`` entering layer 0: the embedding output and ``scale * x0`` (``resi_dual.py:107``)."""
    return x0, x0 * scale


def encoder_layer(
    x: Tensor,
    res: Tensor,
    attn_w: AttnWeights,
    ffn_w: FFNWeights,
    ln_attn: Norm,
    ln_ffn: Norm,
    n_heads: int,
    scale: float = DEFAULT_RES_SCALE,
    key_padding_mask: Tensor | None = None,
    dropout=None,
) -> tuple[Tensor, Tensor]:
    """``resi_dual_layers.py:25-51``; ``dropout`` is a callable (identity when ``None``, i.e. eval)."""
    drop = dropout if dropout is not None else (lambda t: t)
    f = drop(attention(x, x, attn_w, n_heads, key_padding_mask=key_padding_mask))
    res = res + f * scale
    x = ln_attn(f + x)
    f = drop(ffn(x, ffn_w))
    res = res + f * scale
    x = ln_ffn(f + x)
    return x, res


def decoder_layer(
    x: Tensor,
    res: Tensor,
    encoder_out: Tensor | None,
    self_w: AttnWeights,
    cross_w: AttnWeights | None,
    ffn_w: FFNWeights,
    ln_self: Norm,
    ln_cross: Norm | None,
    ln_ffn: Norm,
    n_heads: int,
    scale: float = DEFAULT_RES_SCALE,
    encoder_padding_mask: Tensor | None = None,
    dropout=None,
) -> tuple[Tensor, Tensor]:
    """``resi_dual_layers.py:116-177``; without ``encoder_out`` it is the decoder-only (LM) layer, which the
    release does not have (this project's extension)."""
    drop = dropout if dropout is not None else (lambda t: t)
    f = drop(attention(x, x, self_w, n_heads, causal=True))
    res = res + f * scale
    x = ln_self(x + f)
    if encoder_out is not None:
        f = drop(attention(x, encoder_out, cross_w, n_heads, key_padding_mask=encoder_padding_mask))
        res = res + f * scale
        x = ln_cross(x + f)
    f = drop(ffn(x, ffn_w))
    res = res + f * scale
    x = ln_ffn(x + f)
    return x, res


def stack_output(x: Tensor, res: Tensor, final_ln: Norm, alpha: float = 1.0) -> Tensor:
    """``x * alpha + layer_norm(res)`` (``resi_dual.py:131``, ``283``)."""
    return x * alpha + final_ln(res)


def encoder(
    x0: Tensor,
    layers: list[dict],
    final_ln: Norm,
    n_heads: int,
    scale: float = DEFAULT_RES_SCALE,
    alpha: float = 1.0,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Whole encoder from its embedding output ``x0`` (already zeroed at padding, ``resi_dual.py:77-78``)."""
    x, res = stack_start(x0, scale)
    for p in layers:
        x, res = encoder_layer(
            x, res, p["attn_w"], p["ffn_w"], p["ln_attn"], p["ln_ffn"], n_heads, scale, key_padding_mask
        )
    return stack_output(x, res, final_ln, alpha)


def decoder(
    y0: Tensor,
    encoder_out: Tensor | None,
    layers: list[dict],
    final_ln: Norm,
    n_heads: int,
    scale: float = DEFAULT_RES_SCALE,
    alpha: float = 1.0,
    encoder_padding_mask: Tensor | None = None,
) -> Tensor:
    """Whole decoder (features before the output projection) from its embedding output ``y0``."""
    x, res = stack_start(y0, scale)
    for p in layers:
        x, res = decoder_layer(
            x,
            res,
            encoder_out,
            p["self_w"],
            p.get("cross_w"),
            p["ffn_w"],
            p["ln_self"],
            p.get("ln_cross"),
            p["ln_ffn"],
            n_heads,
            scale,
            encoder_padding_mask,
        )
    return stack_output(x, res, final_ln, alpha)
