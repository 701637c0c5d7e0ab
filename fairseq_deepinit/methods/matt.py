"""Merged attention, MAtt (Zhang, Titov & Sennrich 2019, "Improving Deep Transformer with Depth-Scaled
Initialization and Merged Attention", section "Merged Attention Model"): ``--decoder-layer-type matt``
with ``--matt-self-branch`` and ``--matt-share-v``.

Every decoder layer has two sub-layers: a simplified average attention summed with the cross-attention
through one shared W_o, then the FFN (the layer: :mod:`fairseq_deepinit.matt.layer`; parameter counts:
:mod:`fairseq_deepinit.matt.params`). ``dsinit_matt_<size>`` is the paper's DS-Init + MAtt model.
"""

from __future__ import annotations

from ..errors import DeepInitConfigError
from ..matt.layer import SELF_BRANCHES, MAttDecoderLayer, MAttOptions
from .exporting import EXPORT_NEUTRAL, never
from .record import CROSS_ATTENTION, FLAG, LayerType, Method, Option, Rule


def validate(p, spec) -> None:
    """W_v shared with the cross-attention needs its value projection to map into the decoder's width."""
    if p.matt_share_v and spec.encoder is not None:
        enc, dec = spec.encoder.dim, spec.decoder.dim
        if enc is not None and dec is not None and enc != dec:
            raise DeepInitConfigError(
                "MAtt shares W_v with the cross-attention (--matt-share-v, the default), whose value projection "
                f"({enc} -> {dec}) cannot apply to decoder states of size {dec}; use equal --encoder-embed-dim "
                "and --decoder-embed-dim or pass --no-matt-share-v"
            )


METHOD = Method(
    name="matt",
    title="Merged attention (MAtt)",
    paper="Zhang, Titov & Sennrich 2019, sec. 4, Table 3",
    summary="decoder layers of two sub-layers: average attention + cross-attention through one W_o, then the FFN; "
    "O(1) decoding state",
    code="bzhangGo/zero func.py (dot_attention), models/transformer_aan.py",
    enabled_by="decoder_layer_type=matt",
    options=(
        Option(
            "matt_self_branch",
            str,
            "aan",
            "matt: the self branch merged with the encoder-decoder attention: aan (the paper's simplified "
            "average attention, default), self-attn or gated-aan (the paper's Table 3 ablations)",
            choices=SELF_BRANCHES,
        ),
        Option(
            "matt_share_v",
            bool,
            True,
            "matt: use the cross-attention's value projection as the average branch's W_v (default: the "
            "released code and the paper's parameter count)",
            negative="--no-matt-share-v",
            negative_help="matt: give the average branch a W_v of its own (the equation read literally; an ablation)",
        ),
    ),
    layer_types=(
        LayerType(
            "matt",
            MAttDecoderLayer,
            "merged attention: SAAN + cross-attention, one W_o",
            requires=(Rule(CROSS_ATTENTION, (True,), "merges the self branch into the encoder-decoder attention"),),
            export=never(
                "--decoder-layer-type matt (MAtt): its decoder layer merges an average-attention branch into the "
                "cross-attention through one W_o; a stock transformer and CTranslate2's TransformerSpec have "
                "separate self- and cross-attention sub-layers"
            ),
            options=lambda p: MAttOptions(p.matt_self_branch, bool(p.matt_share_v)),
        ),
    ),
    excludes=(
        Rule(FLAG, ("cross_self_attention",), "it changes the standard decoder layer's sub-layers; MAtt has none such"),
    ),
    validate=validate,
    export=EXPORT_NEUTRAL,  # its options shape the MAtt layer, which its layer type declares
    describe=lambda p: f"matt={p.matt_self_branch}" + (",shared-v" if p.matt_share_v else ""),
    families={
        # DS-Init + MAtt, the paper's model; MAtt alone (fairseq 0.8/0.9 baseline init) for its ablation rows
        "dsinit_matt": dict(init_scheme="ds-init", decoder_layer_type="matt"),
        "matt": dict(decoder_layer_type="matt"),
    },
    architectures={
        # IWSLT14 De-En, 12 + 12 layers of the IWSLT small dims (the paper's 35.63 BLEU row)
        "dsinit_matt_iwslt_de_en_12l": (
            "iwslt_de_en",
            dict(init_scheme="ds-init", decoder_layer_type="matt", encoder_layers=12, decoder_layers=12),
        ),
    },
)
