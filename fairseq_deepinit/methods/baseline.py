"""The fairseq 0.8/0.9 baseline initialisation (``--init-scheme xavier``), today's fairseq (``fairseq``), and
the Post-LN / Pre-LN baselines (Xu et al. 2020, eq. 1-2: "v1" and tensor2tensor's "v2").

The initialisation itself is a building block every other scheme but ``fairseq`` starts from
(:func:`fairseq_deepinit.modules.init.apply_baseline`). The plain residual ``x + f(x)``
(``--residual-scale none``) and fairseq's decoder layer (``--decoder-layer-type standard``) are the
baseline's too, the values every other method composes with.
"""

from __future__ import annotations

from ..modules.init import apply_baseline
from ..modules.layers import DeepInitDecoderLayer
from ..modules.residual import Residual
from .exporting import EXPORT_NEUTRAL
from .record import InitScheme, LayerType, Method, ResidualScaling

METHOD = Method(
    name="baseline",
    title="Post-LN / Pre-LN baselines",
    paper="Vaswani et al. 2017; Xu et al. 2020, eq. 1-2 (v1 / v2); fairseq 0.8/0.9 init",
    summary="Post-LN or Pre-LN (`--encoder-normalize-before --decoder-normalize-before`), the papers' fairseq "
    "0.8/0.9 init (`xavier`, default) or today's fairseq 0.12 init (`fairseq`)",
    code="fairseq 0.9 `fairseq/modules/multihead_attention.py` reset_parameters",
    init_schemes=(
        InitScheme("fairseq", lambda model, p, spec: None, "today's fairseq 0.12 initialisation, untouched"),
        InitScheme(
            "xavier", apply_baseline, "fairseq 0.8/0.9 baseline: xavier_uniform, zero biases (the papers' baseline)"
        ),
    ),
    residual_scalings=(
        ResidualScaling("none", lambda stack, sublayer, p: Residual(), "x + f(x)", export=EXPORT_NEUTRAL),
    ),
    layer_types=(LayerType("standard", DeepInitDecoderLayer, "fairseq's decoder layer", export=EXPORT_NEUTRAL),),
    export=EXPORT_NEUTRAL,  # init schemes
    families={
        "postln": dict(init_scheme="xavier"),
        "preln": dict(init_scheme="xavier", norm_placement="pre"),
    },
)
