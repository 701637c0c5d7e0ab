"""Norm placement as one switch (post, pre, peri, reordered), the embedding norm, and HybridNorm.

One residual sub-layer ``F`` (attention, cross-attention or FFN) under each placement, as released:

- ``post`` (Vaswani et al.; fairseq's default): ``h = Norm(x + F(x))``.
- ``pre``: ``h = x + F(Norm(x))``; OLMo-core ``TransformerBlock.forward``
  (``src/olmo_core/nn/transformer/block.py:144-153``, commit fa6c501).
- ``peri`` (Peri-LN, Kim et al. 2025; Sandwich-LN is the same placement): ``h = x + Norm_out(F(Norm_in(x)))``;
  OLMo-core ``PeriNormTransformerBlock`` (``block.py:312-373``: ``post_attention_norm`` and
  ``post_feed_forward_norm`` added next to the pre-norms, forward at ``348-361``). lmsdss/LayerNorm-Scaling
  ``peft_pretraining/modeling_llama.py:505-524`` (``NORM_TYPE=sandwich``) computes the same.
- ``reordered`` (OLMo 2): ``h = x + Norm(F(x))``; OLMo-core ``ReorderedNormTransformerBlock``
  (``block.py:293-309``), HF ``Olmo2DecoderLayer.forward``, allenai/OLMo ``olmo/model.py`` ``norm_after``
  (``OLMoSequentialBlock.forward``: ``attn_norm`` applied to ``attn_out(...)``, ``ff_norm`` to ``ff_out(...)``).

Final norm after the last layer: OLMo-core always has one (the LM head's ``LMHeadConfig(layer_norm=...)``,
``lm_head.py:230``), for pre, peri and reordered alike; HF Olmo2Model has ``self.norm`` too. fairseq builds
it only when ``normalize_before`` (``fairseq/models/transformer/transformer_encoder.py:100-103``,
``transformer_decoder.py:126-129``),
i.e. not for post. :func:`has_final_norm` records this; peri and reordered need one built explicitly.

Embedding norm: OLMo-core ``Transformer.__init__`` (``src/olmo_core/nn/transformer/model.py:110-136``)
builds ``embedding_norm`` (off by default; the Peri-LN ladder ``src/scripts/train/ladder/2026Q1/
more_norms_ladder.py`` turns it on as ``LayerNormConfig(name=rms, eps=1e-6, bias=False)``) and applies it
in ``forward`` (``model.py:588-592``) to ``embeddings(ids) * embed_scale``; OLMo v1 ``emb_norm``
(``olmo/model.py:1140-1141, 1321-1322``) normalises the token embedding *before* learned positions are
added (``1324-1330``). fairseq's own ``--layernorm-embedding`` normalises ``embed_scale * tok + positions``
(``transformer_encoder.py:125-129``). See
:func:`embed`.

HybridNorm (Zhuo et al. 2025, BryceZhuo/HybridNorm commit f0dd605, ``dense_model/olmo/model.py``): per head
q, k, v norms inside attention (``433-473``, applied at ``668-673``; optional context norm ``712-713``),
no norm before attention, and the FFN fed and bypassed by the normalised stream (``814-893``):
``y = x + Attn_qkvnorm(x)``, ``z = Norm(y)``, ``out = z + FFN(z)``; per-layer overrides
(``474-489``, HybridNorm*: layer 0 ``{'attn_norm': True, 'ffn_residual': False}``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from .common import AttnWeights, FFNWeights, Norm, attention, ffn

PLACEMENTS = ("post", "pre", "peri", "reordered")

#: Which norms a sub-layer owns under each placement ("in": before F, "out": after F or after the add).
NORMS_PER_SUBLAYER = {"post": ("out",), "pre": ("in",), "peri": ("in", "out"), "reordered": ("out",)}


def sublayer(x: Tensor, f: Callable[[Tensor], Tensor], placement: str, norm_in: Norm | None, norm_out: Norm | None):
    """One residual sub-layer. For ``post`` ``norm_out`` follows the residual add; for ``reordered`` and
    ``peri`` it normalises ``F``'s output before the add."""
    if placement == "post":
        return norm_out(x + f(x))
    if placement == "pre":
        return x + f(norm_in(x))
    if placement == "peri":
        return x + norm_out(f(norm_in(x)))
    if placement == "reordered":
        return x + norm_out(f(x))
    raise ValueError(f"unknown placement {placement!r}")


def has_final_norm(placement: str) -> bool:
    """Whether the stack ends with a norm (see module docstring for the sources)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}")
    return placement != "post"


def encoder_layer(
    x: Tensor,
    attn_w: AttnWeights,
    ffn_w: FFNWeights,
    norms: dict[str, Norm],
    placement: str,
    n_heads: int,
    key_padding_mask: Tensor | None = None,
    **attn_kwargs,
) -> Tensor:
    """Encoder layer (self-attention, FFN). ``norms`` keys: ``"attn.in"``, ``"attn.out"``, ``"ffn.in"``,
    ``"ffn.out"`` (only those the placement owns, see ``NORMS_PER_SUBLAYER``)."""

    def att(h):
        return attention(h, h, attn_w, n_heads, key_padding_mask=key_padding_mask, **attn_kwargs)

    x = sublayer(x, att, placement, norms.get("attn.in"), norms.get("attn.out"))
    return sublayer(x, lambda h: ffn(h, ffn_w), placement, norms.get("ffn.in"), norms.get("ffn.out"))


def decoder_layer(
    x: Tensor,
    encoder_out: Tensor | None,
    self_w: AttnWeights,
    cross_w: AttnWeights | None,
    ffn_w: FFNWeights,
    norms: dict[str, Norm],
    placement: str,
    n_heads: int,
    encoder_padding_mask: Tensor | None = None,
    **attn_kwargs,
) -> Tensor:
    """Decoder layer (causal self-attention, cross-attention, FFN); without ``encoder_out`` it is the
    decoder-only LM layer the released code describes. Cross-attention under ``peri``/``reordered`` is this
    project's extension (norm keys ``"cross.in"``/``"cross.out"``): the released blocks have no cross-attention.
    Only queries come from the normalised stream; the keys are the encoder output as fairseq passes it.
    """

    def self_att(h):
        return attention(h, h, self_w, n_heads, causal=True, **attn_kwargs)

    x = sublayer(x, self_att, placement, norms.get("attn.in"), norms.get("attn.out"))
    if encoder_out is not None:

        def cross(h):
            return attention(h, encoder_out, cross_w, n_heads, key_padding_mask=encoder_padding_mask, **attn_kwargs)

        x = sublayer(x, cross, placement, norms.get("cross.in"), norms.get("cross.out"))
    return sublayer(x, lambda h: ffn(h, ffn_w), placement, norms.get("ffn.in"), norms.get("ffn.out"))


def embed(
    tok: Tensor,
    pos: Tensor | None,
    embed_scale: float | None,
    norm: Norm | None,
    source: str = "olmo_core",
) -> Tensor:
    """Embedding output before the first layer (dropout left out).

    - ``"olmo_core"`` (``model.py:588-592``): ``norm(tok * embed_scale)``; positions are RoPE (not added);
      a ``pos`` given here is added after the norm, which is this project's translation for absolute
      positions (keeps the norm's claim "the first layer sees unit-RMS token embeddings").
    - ``"olmo_v1"`` (``olmo/model.py:1318-1330``): ``norm(tok) + pos``, no embed scale.
    - ``"fairseq"`` (``--layernorm-embedding``, ``transformer_encoder.py:125-129``):
      ``norm(embed_scale * tok + pos)``.
    """
    s = 1.0 if embed_scale is None else embed_scale
    n = norm if norm is not None else (lambda h: h)
    if source == "olmo_core":
        h = n(tok * s)
        return h if pos is None else h + pos
    if source == "olmo_v1":
        h = n(tok)
        return h if pos is None else h + pos
    if source == "fairseq":
        h = tok * s
        return n(h if pos is None else h + pos)
    raise ValueError(f"unknown source {source!r}")


# ---------------------------------------------------------------------------------------------------
# HybridNorm


def hybridnorm_layer_config(layer_id: int, star: bool = False) -> dict[str, bool]:
    """The released ``layer_norm_pos_configs[layer_id]`` (``model.py:474-486``) for the 1.2B config
    (``configs/exps/1.2B-dense-HybriedNorm.yaml``: ``attn_norm: false``, ``ffn_norm: true``,
    ``attn_residual_after_norm: false``, ``ffn_residual_after_norm: true``); ``star`` applies the README's
    HybridNorm* override ``{0: {'attn_norm': True, 'ffn_residual': False}}``."""
    cfg = {"attn_norm": False, "attn_residual": False, "ffn_norm": True, "ffn_residual": True}
    if star and layer_id == 0:
        cfg.update(attn_norm=True, ffn_residual=False)
    return cfg


def olmo_sequential_block(
    x: Tensor,
    attn_w: AttnWeights,
    ffn_w: FFNWeights,
    cfg: dict[str, bool],
    n_heads: int,
    attn_norm: Norm | None,
    ffn_norm: Norm | None,
    q_norm: Norm | None = None,
    k_norm: Norm | None = None,
    v_norm: Norm | None = None,
    ctx_norm: Norm | None = None,
    causal: bool = True,
    **attn_kwargs,
) -> Tensor:
    """HybridNorm's ``OLMoSequentialBlock.forward`` (``model.py:814-893``) with per-head q/k/v norms.

    ``attn_residual`` replaces the stream by its normalised value before attention (``816-821``);
    ``ffn_residual`` takes the FFN's residual after the norm (``870-880``), which is what makes the FFN
    part "Post-Norm" in the paper's sense: ``z = Norm(y); out = z + FFN(z)``.
    """
    if cfg["attn_norm"]:
        if cfg["attn_residual"]:
            x = attn_norm(x)
            h = x
        else:
            h = attn_norm(x)
    else:
        h = x
    att = attention(
        h,
        h,
        attn_w,
        n_heads,
        causal=causal,
        q_norm=q_norm,
        k_norm=k_norm,
        v_norm=v_norm,
        ctx_norm=ctx_norm,
        norm_scope="head",
        **attn_kwargs,
    )
    x = x + att
    if cfg["ffn_norm"]:
        og_x = x
        x = ffn_norm(x)
        if cfg["ffn_residual"]:
            og_x = x
    else:
        og_x = x
    return og_x + ffn(x, ffn_w)


def hybridnorm_stack(
    x: Tensor,
    layers: list[dict],
    n_heads: int,
    final_norm: Norm,
    star: bool = False,
    causal: bool = True,
) -> Tensor:
    """Blocks then ``ln_f`` (``model.py:1181, 1517``). Each ``layers[i]`` holds ``attn_w``, ``ffn_w``,
    ``attn_norm`` (used only where the config asks for it), ``ffn_norm``, ``q_norm``, ``k_norm``, ``v_norm``."""
    for i, p in enumerate(layers):
        x = olmo_sequential_block(
            x,
            p["attn_w"],
            p["ffn_w"],
            hybridnorm_layer_config(i, star),
            n_heads,
            p.get("attn_norm"),
            p["ffn_norm"],
            p.get("q_norm"),
            p.get("k_norm"),
            p.get("v_norm"),
            p.get("ctx_norm"),
            causal=causal,
        )
    return final_norm(x)


def hybridnorm_init_std(param: str, d_model: int, n_layers: int) -> float:
    """Std of HybridNorm's released 1.2B initialisation (``init_fn: full_megatron``, truncated at 3 std).

    The yaml's ``init_std: 0.013975424859373685`` is ``sqrt(2 / (5 * d_model))`` at ``d_model=2048``;
    ``full_megatron`` uses it for the tied embedding (``model.py:1256-1266``) and ``att_proj``/``ff_proj``
    (``788-795``), and ``init_std / sqrt(2 * n_layers)`` for ``attn_out``/``ff_out`` (``553-561``);
    q/k/v norm gains are 1 (``reset_parameters``). ``param``: ``"embedding"``, ``"qkv"``, ``"ff_in"``,
    ``"attn_out"``, ``"ff_out"``.
    """
    std = math.sqrt(2.0 / (5.0 * d_model))
    if param in ("embedding", "qkv", "ff_in"):
        return std
    if param in ("attn_out", "ff_out"):
        return std / math.sqrt(2.0 * n_layers)
    raise ValueError(f"unknown parameter {param!r}")


HYBRIDNORM_INIT_CUTOFF = 3.0  # init_cutoff_factor: 3 (truncated normal at +-3 std)
