"""Mix-LN (Li, Yin, Liu 2024): the first ``k`` layers Post-LN, the remaining layers Pre-LN.

Released code: pixeli99/MixLN (commit ff45826) ``peft_pretraining/modeling_llama.py``:

- ``NORM_TYPE=post_pre`` and ``POST_NUM=k`` (env, ``265-268``; ``POST_NUM`` defaults to ``'1'``);
- construction ``325-333``: layers ``layer_index < k`` own ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``; later layers own ``input_layernorm`` and ``post_attention_layernorm``
  (the same attribute name plays the FFN *pre*-norm there);
- forward ``565-601``: Post-LN ``h = N_a(x + Attn(x)); out = N_f(h + FFN(h))`` (``566-583``), Pre-LN
  ``h = x + Attn(N_a(x)); out = h + FFN(N_f(h))`` (``584-601``);
- the boundary has no extra norm: the last Post-LN layer's output (already normalised by
  ``post_feedforward_layernorm``) is the first Pre-LN layer's residual stream; ``LlamaModel`` always applies
  its final ``self.norm`` (``929``, applied at ``1077``), whatever the mix.

``k`` in the scripts: ``scripts/run_71m.sh post_pre 3`` on ``configs/llama_71m.json`` (12 layers) and
``scripts/run_1b.sh post_pre 6`` on ``llama_1b.json`` (24 layers); lmsdss/LayerNorm-Scaling's README uses
3 for 130M (12 layers) and 6 for 250M/350M/1B (24 layers): ``k / L = 0.25`` everywhere, the paper's
Post-LN ratio ``alpha = 0.25`` (``k = floor(alpha * L)``; the paper text is not in this project's stored
material, see ``docs/reference/new_methods.md``).

Initialisation (``_init_weights``, ``818-839``): ``nn.Linear`` ``normal(0, 0.02)``, embedding
``normal(0, sqrt(2/5))``; the LayerNorm-Scaling authors call the ``~0.6`` embedding std a leftover of an
ablation branch and fixed their copy to 0.02 (lmsdss/LayerNorm-Scaling issue #6).
"""

from __future__ import annotations

import math

from torch import Tensor

from .common import AttnWeights, FFNWeights, Norm, attention, ffn

POST_LN_RATIO = 0.25
LINEAR_INIT_STD = 0.02
EMBEDDING_INIT_STD_MIXLN = math.sqrt(2 / 5)  # modeling_llama.py:837
EMBEDDING_INIT_STD_LNS = 0.02  # lmsdss/LayerNorm-Scaling modeling_llama.py:876


def num_post_layers(n_layers: int, ratio: float = POST_LN_RATIO, rounding: str = "floor") -> int:
    """``k`` for ``n_layers``: ``floor(ratio * L)`` (3 of 12, 6 of 24; 1 of 6, 4 of 18) or ``"round"``
    (Python's round-half-even: 2 of 6, 4 of 18). Which rounding applies at depths the scripts never ran is
    the implementer's decision."""
    x = ratio * n_layers
    if rounding == "floor":
        return math.floor(x)
    if rounding == "round":
        return round(x)
    raise ValueError(f"unknown rounding {rounding!r}")


def layer_kinds(n_layers: int, k: int) -> list[str]:
    """``"post"`` for ``layer_index < k`` (``modeling_llama.py:566``), ``"pre"`` after."""
    return ["post" if i < k else "pre" for i in range(n_layers)]


def post_layer(x: Tensor, attn_w: AttnWeights, ffn_w: FFNWeights, n_attn: Norm, n_ffn: Norm, n_heads: int, **kw):
    """``modeling_llama.py:566-583`` (causal self-attention as in the decoder-only release)."""
    x = n_attn(x + attention(x, x, attn_w, n_heads, causal=True, **kw))
    return n_ffn(x + ffn(x, ffn_w))


def pre_layer(x: Tensor, attn_w: AttnWeights, ffn_w: FFNWeights, n_attn: Norm, n_ffn: Norm, n_heads: int, **kw):
    """``modeling_llama.py:584-601``."""
    h = n_attn(x)
    x = x + attention(h, h, attn_w, n_heads, causal=True, **kw)
    return x + ffn(n_ffn(x), ffn_w)


def lm_stack(x: Tensor, layers: list[dict], k: int, n_heads: int, final_norm: Norm) -> Tensor:
    """The decoder-only model: ``k`` Post-LN layers, the rest Pre-LN, then the final norm (always); ``layers``
    as :func:`.common.lm_layers` gives them."""
    for kind, p in zip(layer_kinds(len(layers), k), layers, strict=True):
        fn = post_layer if kind == "post" else pre_layer
        x = fn(x, p["attn_w"], p["ffn_w"], p["norm_attn"], p["norm_ffn"], n_heads)
    return final_norm(x)


def translation_layer(
    x: Tensor,
    kind: str,
    encoder_out: Tensor | None,
    self_w: AttnWeights,
    cross_w: AttnWeights | None,
    ffn_w: FFNWeights,
    norms: dict[str, Norm],
    n_heads: int,
    causal: bool,
    self_padding_mask: Tensor | None = None,
    encoder_padding_mask: Tensor | None = None,
) -> Tensor:
    """Encoder (``encoder_out=None, causal=False``) or decoder layer of the mix (project extension):
    a Post-LN decoder layer normalises after each of its three residual adds, a Pre-LN one before each
    sub-layer; ``norms`` keys ``"attn"``, ``"cross"``, ``"ffn"`` (fairseq's ``self_attn_layer_norm``,
    ``encoder_attn_layer_norm``, ``final_layer_norm`` play both roles)."""

    def att(h):
        return attention(h, h, self_w, n_heads, causal=causal, key_padding_mask=self_padding_mask)

    subs = [(att, norms["attn"])]
    if encoder_out is not None:
        subs.append(
            (
                lambda h: attention(h, encoder_out, cross_w, n_heads, key_padding_mask=encoder_padding_mask),
                norms["cross"],
            )
        )
    subs.append((lambda h: ffn(h, ffn_w), norms["ffn"]))
    for f, n in subs:
        x = n(x + f(x)) if kind == "post" else x + f(n(x))
    return x
