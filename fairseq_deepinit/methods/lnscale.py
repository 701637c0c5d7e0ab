"""LayerNorm Scaling, LNS (Sun et al. 2025, "The Curse of Depth in Large Language Models"):
``--layernorm-scaling``, Pre-LN only; and the released runs' initialisation, ``--init-scheme normal`` /
``normal-scaled``.

Each Pre-LN sub-layer's norm output is multiplied by ``1/sqrt(l)``, l the layer's depth counted from 1;
the stack's final norm is not scaled::

    h = x + Attn(N1(x) / sqrt(l));   out = h + FFN(N2(h) / sqrt(l))

Released code: lmsdss/LayerNorm-Scaling @ 3ac54dd ``peft_pretraining/modeling_llama.py:427-454``
(``scale_factor = 1 / math.sqrt(self.layer_index + 1)`` at 432 and 449, ``layer_index`` from
``range(num_hidden_layers)`` at 967; the final ``self.norm``, 968 and 1116, unscaled); OLMo-core's
``LayerNormScaledTransformerBlock`` (``src/olmo_core/nn/transformer/block.py:232-290``) is the same rule.
The factor is the layer's ``input_scale`` (a plain float, set by :func:`setup_lns_layer` from
``layer.layer_idx``), applied in :func:`~fairseq_deepinit.modules.sublayer.sublayer_input` as one
multiplication of the norm's output by a Python float, as the released line ``scale_factor *
hidden_states`` does (layer 1's factor is 1: nothing is computed). Folding the factor into the norm's
affine (``N_{s w, s b}``) would give the same function in exact arithmetic but other roundings and
another parametrisation (gradients of the norm's gain), so it is not done.

The snapshot's string test does not reach its LNS branch: both ``__init__`` (265, 292) and ``forward``
(403, 427) lower-case ``NORM_TYPE`` and then compare with ``'LNS'``; the README's ``bash run_130m.sh LNS``
therefore builds layers without norms whose forward returns its input (no branch matches). The plugin
implements the branch's lines (the paper's rule, and OLMo-core's), not that fall-through.

Encoder-decoder translation is this project's extension: l counts from 1 in each stack, every pre-norm
of a decoder layer (self-attention, cross-attention, FFN) takes the layer's factor, the stacks' final
norms none.

Initialisation of the released runs (``_init_weights``, modeling_llama.py:857-878): every ``nn.Linear``
and ``nn.Embedding`` N(0, 0.02) (``initializer_range`` of every config, 9M to 7B), biases zero, the
padding row zero, no depth scaling: ``--init-scheme normal``. ``NORM_TYPE=scale_pre`` marks o_proj and
down_proj (``is_scaled_layer``, 159-160, 191-192) for N(0, 0.02 / sqrt(2 L)), the "Scaled Initialization"
the README ("A Quick Word Before You Start", line 41) and the paper's footnote 1 say diminishes LNS:
``--init-scheme normal-scaled`` (self-attention and cross-attention out_proj and fc2, L the layers of the
stack). LNS with a depth-scaled init is allowed and logged as a warning (:func:`warn_lns_cancellations`).
"""

from __future__ import annotations

import logging
import math
from typing import List

import torch
import torch.nn as nn

from ..errors import DeepInitConfigError
from .record import InitScheme, Method, Option, iter_layers, missing_pre_ln_flags

logger = logging.getLogger(__name__)

INIT_STD = 0.02  # configs/llama_*.json "initializer_range"

# init schemes that scale weights by the depth and can meet LNS (a Pre-LN feature). DeepNorm, Admin
# (profiled and closed form), ReZero+PostLN and B2T scale by depth too but are Post-LN, which LNS refuses first.
DEPTH_SCALED_INITS = {
    "ds-init": "DS-Init draws layer l's weights within 1/sqrt(l) of xavier's bound",
    "t-fixup": "T-Fixup scales v/out/fc1/fc2 by L^-1/4",
    "normal-scaled": "normal-scaled draws out_proj and fc2 with 0.02/sqrt(2L) (the README's Scaled Initialization)",
}


def lns_factor(index: int) -> float:
    """``1/sqrt(l)`` for the layer of depth ``index`` (from 1); modeling_llama.py:432 with l = layer_index + 1."""
    return 1 / math.sqrt(index)


def setup_lns_layer(layer: nn.Module, cfg) -> None:
    """Layer set-up: the layer's ``input_scale`` (every Pre-LN norm output of the layer times it)."""
    if getattr(cfg, "layernorm_scaling", False):
        layer.input_scale = lns_factor(layer.layer_idx)


def lns_cancellations(cfg) -> List[str]:
    """What in the configuration undoes LNS's scaling: a depth-scaled init (the authors' warning), or a norm
    inside the branch that renormalises what the scaled norm output produced (Sub-LN, NormFormer)."""
    out = []
    if cfg.init_scheme in DEPTH_SCALED_INITS:
        out.append(f"--init-scheme {cfg.init_scheme} ({DEPTH_SCALED_INITS[cfg.init_scheme]})")
    if getattr(cfg, "subln", False):
        out.append("--subln (its norms inside each branch undo the branch input's scale)")
    normformer = [f for f in ("scale_attn", "scale_fc") if getattr(cfg, f, False)]
    if normformer:
        flags = " ".join("--" + f.replace("_", "-") for f in normformer)
        out.append(f"{flags} (NormFormer's norms inside the branches undo the branch input's scale)")
    return out


def warn_lns_cancellations(model: nn.Module, cfg) -> None:
    """Post-init: one warning when the configuration cancels LNS (the model is built as asked)."""
    if not getattr(cfg, "layernorm_scaling", False):
        return
    reasons = lns_cancellations(cfg)
    if reasons:
        logger.warning(
            "--layernorm-scaling with "
            + "; ".join(reasons)
            + ": the LNS authors found that depth-scaled initialisation diminishes LNS's effect and recommend "
            "plain normal init (--init-scheme normal, or xavier/fairseq)"
        )


def validate_lns_args(args) -> None:
    if not args.layernorm_scaling:
        return
    if args.norm_type == "none":
        raise DeepInitConfigError(
            "--layernorm-scaling scales each Pre-LN norm's output and --norm-type none removes the norms; drop one"
        )
    flags = missing_pre_ln_flags(args)
    if flags:
        raise DeepInitConfigError(
            f"--layernorm-scaling scales the output of each Pre-LN norm (under Post-LN it would scale the residual "
            f"stream itself); add {flags} (the lnscale_* architectures set them)"
        )
    if getattr(args, "norm_placement", "auto") in ("peri", "reordered"):
        raise DeepInitConfigError(
            f"--layernorm-scaling is defined on Pre-LN (OLMo-core's LayerNormScaledTransformerBlock scales the "
            f"pre-norm only) and --norm-placement {args.norm_placement} is another placement; use "
            "--norm-placement pre or drop --layernorm-scaling"
        )
    if getattr(args, "mix_ln", False):
        raise DeepInitConfigError(
            "--layernorm-scaling scales every layer's pre-norm and --mix-ln makes the first layers Post-LN (the "
            "released code offers them as alternatives, NORM_TYPE=LNS or post_pre); drop one"
        )


@torch.no_grad()
def normal_init(model: nn.Module, cfg, embed_std: float = INIT_STD, scaled: bool = False) -> None:
    """modeling_llama.py:857-878 (``_init_weights``) on every module of the model, in module order: each
    ``nn.Linear`` N(0, 0.02) with a zero bias (``scaled``: out_proj and fc2 N(0, 0.02 / sqrt(2 L)), L the
    layers of the layer's stack), each ``nn.Embedding`` (words, learned positions) N(0, ``embed_std``) with
    a zero padding row. An output projection tied to the word embedding keeps the embedding's draw. Norms
    keep their ones and zeros."""
    depth = {"encoder": cfg.encoder.layers, "decoder": cfg.decoder.layers}
    scaled_std = {}
    if scaled:
        for stack, _l, layer in iter_layers(model):
            for linear in [a.out_proj for a in layer.attention_modules()] + [layer.fc2]:
                scaled_std[id(linear)] = INIT_STD / math.sqrt(2 * depth[stack])
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in embedding_weights:
            m.weight.normal_(mean=0.0, std=scaled_std.get(id(m), INIT_STD))
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(mean=0.0, std=embed_std)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()


def describe_lns(args) -> str:
    return "layernorm-scaling=1/sqrt(l)" if args.layernorm_scaling else ""


METHOD = Method(
    name="lnscale",
    title="LayerNorm Scaling",
    paper="Sun et al. 2025 (The Curse of Depth in Large Language Models)",
    summary="Pre-LN with each norm output times 1/sqrt(l), l the layer's depth; final norm unscaled; the released "
    "N(0, 0.02) init (`normal`) and its depth-scaled variant (`normal-scaled`)",
    code="lmsdss/LayerNorm-Scaling @ 3ac54dd peft_pretraining/modeling_llama.py:427-454,857-878",
    options=(
        Option(
            "layernorm_scaling",
            bool,
            False,
            "LayerNorm Scaling (Sun et al. 2025): every Pre-LN norm output of layer l times 1/sqrt(l), l from 1 per "
            "stack; the final norm unscaled (docs/schemes.md)",
        ),
    ),
    init_schemes=(
        InitScheme(
            "normal",
            lambda model, cfg: normal_init(model, cfg),
            "N(0, 0.02) for every Linear and embedding, zero biases (the LNS and Mix-LN releases, HF LLaMA)",
            embeddings=True,
        ),
        InitScheme(
            "normal-scaled",
            lambda model, cfg: normal_init(model, cfg, scaled=True),
            "normal, with out_proj and fc2 N(0, 0.02/sqrt(2L)) (the LNS release's scale_pre, OLMo-style)",
            embeddings=True,
        ),
    ),
    validate=validate_lns_args,
    describe=describe_lns,
    layer_setup=setup_lns_layer,
    post_init=warn_lns_cancellations,
    families={
        "lnscale": dict(
            init_scheme="xavier", layernorm_scaling=True, encoder_normalize_before=True, decoder_normalize_before=True
        ),
    },
)
