"""The ``fairseq-train`` commands of ``deepinit-compare``: the user's arguments, the candidate's options,
the depth, and the comparison's budget and logging.

The user's arguments describe the full-length run (width, batch, lr, warm-up, precision, device, and its
own ``--max-update``, logging and validation intervals). The comparison keeps them all and sets, after
them (fairseq's last value wins): ``--max-update U``, validation and a checkpoint every ``--valid-every``
updates, a json log line with the per-layer gradient norms on every update (``--diagnostics-interval 1
--diagnostics-stats grad --log-interval 1``: update 1's are the initial model's), and the save dir. The
command to continue a candidate at full length is the same command from the same save dir with the
user's own values of those options (or fairseq's defaults where the user gave none).

The criterion is the user's with the divergence guard: ``label_smoothed_cross_entropy`` and
``cross_entropy`` become their ``_diagnostics`` versions (the same loss, plus the guard and the per-layer
statistics); with no ``--criterion``, a translation data-bin gets ``label_smoothed_cross_entropy_diagnostics``
and a language model's ``cross_entropy_diagnostics`` (fairseq's defaults' losses).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

from ..errors import DeepInitConfigError
from . import candidates as cands

# set by deepinit-compare itself: a user's value would be silently overridden, so it is refused
OWNED = {
    "--arch": "the architecture is the candidate's (--methods)",
    "--encoder-layers": "the depth is --depth",
    "--decoder-layers": "the depth is --depth",
    "--save-dir": "each candidate saves under --out",
    "--user-dir": "the plugin is added by deepinit-compare",
    "--no-divergence-guard": "the comparison needs the divergence guard",
    "--no-last-checkpoints": "resuming needs checkpoint_last.pt",
    "--no-save": "resuming needs checkpoints",
    "--restore-file": "each candidate resumes from its own checkpoint_last.pt",
}
# the comparison's values replace the user's, which stay in the command that continues at full length
FULL_LENGTH = (
    "--max-update",
    "--log-interval",
    "--log-format",
    "--validate-interval-updates",
    "--save-interval-updates",
    "--keep-interval-updates",
    "--diagnostics-interval",
    "--diagnostics-stats",
)
DIAGNOSTICS = {
    "label_smoothed_cross_entropy": "label_smoothed_cross_entropy_diagnostics",
    "cross_entropy": "cross_entropy_diagnostics",
}
DEFAULT_CRITERION = {cands.TRANSLATION: "label_smoothed_cross_entropy", cands.LM: "cross_entropy"}


def split_equals(argv: Sequence[str]) -> List[str]:
    """``--flag=value`` as ``--flag value`` (argparse accepts both; one form is easier to edit)."""
    out: List[str] = []
    for a in argv:
        if a.startswith("--") and "=" in a:
            out += a.split("=", 1)
        else:
            out.append(a)
    return out


def value_of(argv: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag`` in ``argv`` (None when absent)."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def without(argv: Sequence[str], flags: Sequence[str]) -> List[str]:
    """``argv`` without ``flags`` and their values."""
    out: List[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


@dataclass(frozen=True)
class UserArgs:
    """The user's ``fairseq-train`` arguments, checked: ``base`` without the full-length options and
    the criterion, ``full`` those options as given, and the criterion's diagnostics name."""

    base: Tuple[str, ...]
    full: Tuple[str, ...]
    criterion: str
    task: str | None

    @property
    def cpu(self) -> bool:
        return "--cpu" in self.base


def check_user_args(argv: Sequence[str], kind_of_data) -> Tuple[UserArgs, cands.Task]:
    """Refuse the options deepinit-compare sets itself, map the criterion, and detect the task
    (``kind_of_data(user_task, source, target)`` -> :class:`.candidates.Task`)."""
    argv = split_equals(argv)
    for flag, why in OWNED.items():
        if flag in argv:
            raise DeepInitConfigError(f"drop {flag} from the fairseq-train arguments: {why}")
    user_task = value_of(argv, "--task")
    task = kind_of_data(user_task, value_of(argv, "--source-lang"), value_of(argv, "--target-lang"))
    criterion = value_of(argv, "--criterion") or DEFAULT_CRITERION[task.kind]
    if criterion not in DIAGNOSTICS.values():
        if criterion not in DIAGNOSTICS:
            raise DeepInitConfigError(
                f"--criterion {criterion}: the comparison needs the divergence guard of the diagnostics criteria; "
                f"use {' or '.join(DIAGNOSTICS)} (or their _diagnostics versions)"
            )
        criterion = DIAGNOSTICS[criterion]
    full: List[str] = []
    for flag in FULL_LENGTH:
        v = value_of(argv, flag)
        if v is not None:
            full += [flag, v]
    base = without(argv, [*FULL_LENGTH, "--criterion", "--task"])
    return UserArgs(tuple(base), tuple(full), criterion, user_task), task


def fairseq_train() -> List[str]:
    """``fairseq-train`` next to this Python (the venv's console script), else ``python -m fairseq_cli.train``."""
    script = Path(sys.executable).parent / "fairseq-train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fairseq_cli.train"]


def plugin_dir() -> Path:
    return Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    """What every candidate of one comparison shares."""

    data: Path
    depth: int
    max_update: int
    valid_every: int
    size: str
    task: cands.Task
    user: UserArgs
    out: Path


def _head(name: str, s: Setting) -> List[str]:
    cmd = [*fairseq_train(), str(s.data), "--user-dir", str(plugin_dir())]
    cmd += cands.method_flags(name, s.task, s.user.task, s.size)
    if s.user.task is not None and "--task" not in cmd:
        cmd += ["--task", s.user.task]
    stacks = ("decoder",) if s.task.kind == cands.LM else ("encoder", "decoder")
    for stack in stacks:
        cmd += [f"--{stack}-layers", str(s.depth)]
    return cmd + list(s.user.base) + ["--criterion", s.user.criterion]


def train_command(name: str, s: Setting) -> List[str]:
    """The comparison's command of candidate ``name`` (resumes from its save dir's checkpoint_last.pt)."""
    every = str(s.valid_every)
    cmd = _head(name, s)
    cmd += ["--max-update", str(s.max_update), "--validate-interval-updates", every]
    cmd += ["--save-interval-updates", every, "--keep-interval-updates", "1", "--no-epoch-checkpoints"]
    cmd += ["--diagnostics-interval", "1", "--diagnostics-stats", "grad", "--log-format", "json", "--log-interval", "1"]
    return cmd + ["--save-dir", str(s.out / name)]


def continue_command(name: str, s: Setting) -> List[str]:
    """The command that continues candidate ``name`` from its checkpoint_last.pt at full length: the
    comparison's without its budget and logging, with the user's own values of those options."""
    return _head(name, s) + list(s.user.full) + ["--save-dir", str(s.out / name)]


def printable(cmd: Sequence[str]) -> str:
    """A command as the report shows it: ``fairseq-train ...`` (shell-quoted)."""
    head = 3 if list(cmd[1:2]) == ["-m"] else 1
    return "fairseq-train " + shlex.join(list(cmd[head:]))
