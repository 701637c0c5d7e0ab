"""Mix-LN (Li, Yin, Liu 2024, "Mix-LN: Unleashing the Power of Deeper Layers by Combining Pre-LN and
Post-LN"): ``--mix-ln``, the first k layers of a stack Post-LN, the others Pre-LN, then the stack's final norm.

Released code: pixeli99/MixLN @ ff45826 ``peft_pretraining/modeling_llama.py``: ``NORM_TYPE=post_pre`` and
``POST_NUM=k`` (265-268; ``layer_index < k`` is Post-LN, from 0); construction 325-333; forward 565-601::

    layer i < k  (Post-LN, 566-583):  h = N_a(x + Attn(x));     out = N_f(h + FFN(h))
    layer i >= k (Pre-LN, 584-601):   h = x + Attn(N_a(x));     out = h + FFN(N_f(h))

Nothing sits between the two parts (the last Post-LN layer's normalised output is the first Pre-LN
layer's residual stream), and ``LlamaModel`` applies its final ``self.norm`` (929, applied at 1077)
whatever the mix. Here each layer's placement comes from :func:`layer_placements` (the record's per-layer
rule, resolved into the spec's ``Stack.placements``), and the stacks are built Pre-LN
(``--encoder-/--decoder-normalize-before``), which is what makes fairseq build the final norm
(``transformer_encoder.py:100-103``, ``transformer_decoder.py:126-129``); a Post-LN layer's two (three)
norms are fairseq's sub-layer norms used after the sum.

k: the scripts run ``post_pre 3`` on 12 layers (``scripts/run_71m.sh``, ``configs/llama_71m.json``) and
``post_pre 6`` on 24 (``scripts/run_1b.sh``); the LayerNorm-Scaling README the same for 130M to 1B: k/L =
0.25, the paper's Post-LN ratio alpha. ``--mixln-ratio`` (default 0.25) gives ``k = floor(ratio * L)`` per
stack (floor reproduces both released depths; 1 of 6 layers, 4 of 18), ``--mixln-post-layers k`` sets k
itself (both stacks). Encoder-decoder translation is this project's extension: the split per stack, a
Post-LN decoder layer normalising after each of its three sums.
"""

from __future__ import annotations

import math

from ..errors import DeepInitConfigError
from .exporting import never
from .record import Method, Option, a_norm, plain_residual, pre_ln

POST_LN_RATIO = 0.25  # k / L of every released run (3 of 12, 6 of 24 layers)


def num_post_layers(p, layers: int) -> int:
    """k of a stack of ``layers`` layers: ``--mixln-post-layers`` if given, else ``floor(ratio * layers)``."""
    if p.mixln_post_layers is not None:
        return p.mixln_post_layers
    # the epsilon keeps 0.25 * 12 from flooring to 2 where a ratio's binary value lies just below k / L
    return math.floor(p.mixln_ratio * layers + 1e-9)


def layer_placements(p, layers: int) -> tuple:
    """Each layer of a stack of ``layers``: ``"post"`` for the first k, ``"pre"`` after (modeling_llama.py:566,
    ``layer_index < max_post_norm_layer`` with ``layer_index`` from 0)."""
    k = num_post_layers(p, layers)
    return tuple("post" if index <= k else "pre" for index in range(1, layers + 1))


def _ratio_problem(value: float) -> str | None:
    return (
        None if 0.0 <= value <= 1.0 else f"--mixln-ratio must be in [0, 1] (the Post-LN share of a stack); got {value}"
    )


def _k_problem(value: int) -> str | None:
    return None if value >= 0 else f"--mixln-post-layers must be >= 0; got {value}"


def validate_mixln_args(p, spec) -> None:
    """k given once (``--mixln-post-layers`` or ``--mixln-ratio``: an explicit 0.25 means the default and
    cannot be told from none), and within every stack."""
    k = p.mixln_post_layers
    if k is not None and p.mixln_ratio != POST_LN_RATIO:
        raise DeepInitConfigError(
            f"--mixln-post-layers {k} sets k itself and --mixln-ratio {p.mixln_ratio:g} would compute it from the "
            "depth; give one of them"
        )
    for stack in reversed(spec.stacks):
        if k is not None and k > stack.layers:
            raise DeepInitConfigError(
                f"--mixln-post-layers {k} is more than the {stack.kind.stack}'s {stack.layers} layers; give at most "
                f"{stack.layers}"
            )


def describe_mixln(p) -> str:
    if p.mixln_post_layers is not None:
        return f"mix-ln=post x{p.mixln_post_layers}"
    return f"mix-ln=post ratio {p.mixln_ratio:g}"


METHOD = Method(
    name="mixln",
    title="Mix-LN",
    paper="Li, Yin & Liu 2024 (Mix-LN, ICLR 2025)",
    summary="The first k = floor(0.25 L) layers of each stack Post-LN, the rest Pre-LN, then the stack's final norm",
    code="pixeli99/MixLN @ ff45826 peft_pretraining/modeling_llama.py:265-268,325-333,565-601",
    enabled_by="mix_ln",
    options=(
        Option(
            "mix_ln",
            bool,
            False,
            "Mix-LN (Li et al. 2024): the first k layers of each stack Post-LN, the rest Pre-LN, then the stack's "
            "final norm (needs --encoder-/--decoder-normalize-before; docs/schemes.md)",
        ),
        Option(
            "mixln_ratio",
            float,
            POST_LN_RATIO,
            "Mix-LN: k = floor(ratio * layers) Post-LN layers per stack (default 0.25, the paper's alpha; the "
            "released runs' 3 of 12 and 6 of 24)",
            metavar="R",
            check=_ratio_problem,
        ),
        Option(
            "mixln_post_layers",
            int,
            None,
            "Mix-LN: k itself, the Post-LN layers of each stack (the released scripts' POST_NUM; overrides "
            "--mixln-ratio)",
            metavar="K",
            check=_k_problem,
        ),
    ),
    requires=(
        a_norm("places norms"),
        pre_ln(
            "its first layers are Post-LN and the rest Pre-LN with the stack's final norm, which fairseq builds for a "
            "Pre-LN stack only"
        ),
        plain_residual("keeps the plain residual x + f(x)"),
    ),
    tags={"post-ln-layers": ()},
    validate=validate_mixln_args,
    describe=describe_mixln,
    export=never("--mix-ln mixes Post-LN and Pre-LN layers in one stack; both targets have one placement per stack"),
    layer_placements=layer_placements,
    families={
        "mixln": dict(init_scheme="xavier", mix_ln=True, norm_placement="pre"),
    },
)
