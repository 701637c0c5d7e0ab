"""The one builder of fairseq command lines (``fairseq-train``, ``-generate``, ``-eval_lm``) for every tool.

Every script and benchmark that starts or parses a fairseq command takes its pieces from here: the
command itself with the plugin as ``--user-dir`` (:func:`command`, recorded as :func:`printable`), the
model dimensions (:func:`dims`), the precision (:func:`precision_flags`: fairseq's ``--bf16`` is for
TPUs, the plugin's bf16 is ``--autocast-bf16`` on its own task) and the optimizer every recipe here
shares (:data:`ADAM`). What a tool adds (its schedule, its budget, its logging) stays with the tool.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

from deepinit_tools.paths import REPO, USER_DIR


def adam(optimizer: str = "adam") -> Tuple[str, ...]:
    """Adam with the Transformer's betas (Vaswani et al. 2017, sec. 5.3), as every recipe here;
    ``optimizer="adam_foreach"`` for the plugin's multi-tensor Adam, which depth-muP / CompleteP need
    (it applies their per-group lr / eps multipliers: fairseq_deepinit/methods/depth_mup.py)."""
    return ("--optimizer", optimizer, "--adam-betas", "(0.9, 0.98)")


ADAM = adam()
# methods whose Adam is the plugin's adam_foreach: it applies depth-muP / CompleteP's per-group lr and eps
# multipliers (fairseq's adam is refused for them: fairseq_deepinit/training/depth_mup_trainer.py)
ADAM_FOREACH_METHODS = ("depth_mup", "completep")


def adam_for(method: str) -> Tuple[str, ...]:
    """:func:`adam` as ``method`` (a family name: ``completep``) needs it."""
    return adam("adam_foreach" if method in ADAM_FOREACH_METHODS else "adam")


# the plugin's bf16: autocast on its own translation task (fairseq's --bf16 means TPU)
BF16_TASK = "translation_deepinit"
AUTOCAST_BF16 = "--autocast-bf16"
PRECISIONS = ("fp32", "fp16", "amp", "bf16")


def command(tool: str, data: Path | str, *argv: str, plugin: Path | str = USER_DIR) -> List[str]:
    """``python -m fairseq_cli.<tool> DATA --user-dir PLUGIN ARGV...``: a fairseq command as a child
    process of this Python, with the plugin (default: the one next to the tools) loaded."""
    return [sys.executable, "-m", f"fairseq_cli.{tool}", str(data), "--user-dir", str(plugin), *argv]


def printable(cmd: Sequence[str]) -> str:
    """A :func:`command` as it is recorded: ``fairseq-<tool> ...`` with paths relative to the checkout."""
    tool = cmd[2].rsplit(".", 1)[-1].replace("_", "-")
    return f"fairseq-{tool} " + shlex.join(list(cmd[3:])).replace(str(REPO) + "/", "")


def dims(layers: int, dim: int, ffn: int, heads: int, stacks: Sequence[str] = ("encoder", "decoder")) -> List[str]:
    """The dimension flags of ``stacks`` (a language model: ``("decoder",)``): the layer counts first,
    then each stack's width, FFN width and heads."""
    out = [x for s in stacks for x in (f"--{s}-layers", str(layers))]
    for s in stacks:
        out += [f"--{s}-embed-dim", str(dim), f"--{s}-ffn-embed-dim", str(ffn), f"--{s}-attention-heads", str(heads)]
    return out


def precision_flags(precision: str, has_task: bool = False) -> List[str]:
    """fairseq flags of ``precision``: ``fp16`` = fairseq's ``--fp16``, ``amp`` = ``--amp``; ``bf16`` =
    the plugin's ``--task translation_deepinit --autocast-bf16``, or only ``--autocast-bf16`` where
    the command selects its own task (``has_task``; Admin's ``translation_admin`` has the flag too)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if precision == "bf16":
        return [AUTOCAST_BF16] if has_task else ["--task", BF16_TASK, AUTOCAST_BF16]
    return {"fp32": [], "fp16": ["--fp16"], "amp": ["--amp"]}[precision]


def preprocess(
    train: Path,
    dest: Path,
    valid: Path | None = None,
    tests: Sequence[Path] = (),
    threshold: int | None = None,
    workers: int = 1,
    langs: Tuple[str, str] | None = ("de", "en"),
    extra: Sequence[str] = (),
) -> List[str]:
    """``fairseq-preprocess`` of a language pair (``langs``; None: one language, ``--only-source``, as a
    language model's text): ``train`` (the dictionaries' split, min count ``threshold``), ``valid`` and
    ``tests`` prefixes into ``dest``, then ``extra``."""
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess"]
    cmd += ["--source-lang", langs[0], "--target-lang", langs[1]] if langs else ["--only-source"]
    cmd += ["--trainpref", str(train)]
    if valid is not None:
        cmd += ["--validpref", str(valid)]
    if tests:
        cmd += ["--testpref", ",".join(map(str, tests))]
    cmd += ["--destdir", str(dest), "--workers", str(workers)]
    if threshold is not None:
        cmd += ["--thresholdsrc", str(threshold), "--thresholdtgt", str(threshold)]
    return cmd + list(extra)
