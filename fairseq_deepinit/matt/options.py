"""Options of ``--decoder-layer-type matt`` (``--matt-self-branch``, ``--matt-share-v``), registered
with :mod:`fairseq_deepinit.options` so that they are parsed, resolved and validated with the others.
"""

from __future__ import annotations

from .. import options
from ..errors import DeepInitConfigError
from .layer import SELF_BRANCHES, UNSUPPORTED_FAIRSEQ_FLAGS


def add_args(group) -> None:
    group.add_argument(
        "--matt-self-branch",
        choices=SELF_BRANCHES,
        help="matt: the self branch merged with the encoder-decoder attention: aan (the paper's simplified "
        "average attention, default), self-attn or gated-aan (the paper's Table 3 ablations)",
    )
    group.add_argument(
        "--matt-share-v",
        action="store_true",
        default=None,
        help="matt: use the cross-attention's value projection as the average branch's W_v (default: the "
        "released code and the paper's parameter count)",
    )
    group.add_argument(
        "--no-matt-share-v",
        dest="matt_share_v",
        action="store_false",
        default=None,
        help="matt: give the average branch a W_v of its own (the equation read literally; an ablation)",
    )


def validate(args) -> None:
    """Start-up checks of ``--decoder-layer-type matt`` (its own options are resolved by options.py)."""
    for name in UNSUPPORTED_FAIRSEQ_FLAGS:
        if getattr(args, name, False):
            raise DeepInitConfigError(
                f"--{name.replace('_', '-')} changes the standard decoder layer's sub-layers and has no MAtt "
                "counterpart; drop it or use --decoder-layer-type standard"
            )
    if getattr(args, "no_cross_attention", False):
        raise DeepInitConfigError(
            "--decoder-layer-type matt merges the self branch into the encoder-decoder attention; drop "
            "--no-cross-attention or use --decoder-layer-type standard"
        )
    if args.matt_share_v:
        enc = getattr(args, "encoder_embed_dim", None)
        dec = getattr(args, "decoder_embed_dim", None)
        if enc is not None and dec is not None and enc != dec:
            raise DeepInitConfigError(
                "MAtt shares W_v with the cross-attention (--matt-share-v, the default), whose value projection "
                f"({enc} -> {dec}) cannot apply to decoder states of size {dec}; use equal --encoder-embed-dim "
                "and --decoder-embed-dim or pass --no-matt-share-v"
            )


def describe(args) -> str:
    return f"matt={args.matt_self_branch}" + (",shared-v" if args.matt_share_v else "")


options.register_layer_type_options(
    "matt", {"matt_self_branch": "aan", "matt_share_v": True}, add_args, validate, describe
)
