"""Named MAtt architectures: ``dsinit_matt_<size>`` (the paper's DS-Init + MAtt model), ``matt_<size>``
(MAtt with the fairseq 0.8/0.9 baseline init, the ablation rows) and the paper's IWSLT 12-layer row."""

from __future__ import annotations

from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import transformer_iwslt_de_en

from ..architectures import register_family

# DS-Init + MAtt, the paper's model; MAtt alone (fairseq 0.8/0.9 baseline init) for its ablation rows
register_family("dsinit_matt", dict(init_scheme="ds-init", decoder_layer_type="matt"))
register_family("matt", dict(decoder_layer_type="matt"))


@register_model_architecture("deepinit", "dsinit_matt_iwslt_de_en_12l")
def dsinit_matt_iwslt_12l(args) -> None:
    """IWSLT14 De-En, 12 + 12 layers of the IWSLT small dims (the paper's 35.63 BLEU row)."""
    for key, value in dict(
        init_scheme="ds-init", decoder_layer_type="matt", encoder_layers=12, decoder_layers=12
    ).items():
        if getattr(args, key, None) is None:  # command-line values win, as in every named architecture
            setattr(args, key, value)
    transformer_iwslt_de_en(args)
