"""The fairseq-train command of a converged cell: precision flags per device, batch split by
``--update-freq`` where the per-job memory binds, and the cell's options."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List

from deepinit_tools import fairseq_argv as fa
from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.common import BLIND_FRACTION, METHODS

PACK_FORMAT = "deepinit-converged-pack/1"
LOG_INTERVAL = 50
_VALID = re.compile(r"\| valid \| (\{.*\})\s*$")
_TRAIN = re.compile(r"\| train \| (\{.*\})\s*$")
_EARLY_PATIENCE = "early stop since valid performance hasn't improved"
_EARLY_LR = "early stop since lr is lower than"


class ConvergeError(RuntimeError):
    """An expected failure (bad option, missing data); the message says what to do."""


@dataclass(frozen=True)
class Options:
    """What every cell of one ``converge`` invocation shares."""

    data: Path  # the prepared work dir (bin/, raw/, bpe*/)
    runs: Path
    device: str = "cpu"
    precision: str = "fp32"
    jobs: int = 1
    dim: int = 256
    ffn: int = 1024
    heads: int = 4
    patience: int = 3
    max_epochs: int = 50
    max_tokens: int | None = None  # None: the regime's
    max_tokens_per_job: int | None = None
    threads: int = 1
    beam: int = 5
    stall_bits: float | None = None
    blind_fraction: float = BLIND_FRACTION
    extra_args: str = ""
    deadline: float | None = None  # time.time() after which no training or decoding goes on
    fast_path: bool = True  # on CUDA: --attention-impl sdpa, and adam_foreach where the regime uses Adam


# ---------------------------------------------------------------------------------------------
# commands


def precision_flags(method: str, device: str, precision: str) -> List[str]:
    """fairseq flags for ``precision`` on ``device``: fp16 = fairseq's ``--fp16``; bf16 = the plugin's
    ``--task translation_deepinit --autocast-bf16`` (fairseq's own ``--bf16`` is for TPUs); Admin
    keeps its ``translation_admin`` task, which has ``--autocast-bf16`` too."""
    if precision == "fp32":
        return []
    if device != "cuda":
        raise ConvergeError(f"--precision {precision} needs --device cuda; use --precision fp32 on the CPU")
    if precision not in ("fp16", "bf16"):
        raise ConvergeError(f"--precision {precision!r}: choose fp16, bf16 or fp32")
    return fa.precision_flags(precision, has_task="--task" in METHODS[method][1])


def fast_path_flags(regime_flags: List[str], o: Options) -> List[str]:
    """The regime's flags on the plugin's fast path (CUDA, ``o.fast_path``): fused attention
    (``--attention-impl sdpa``, the same function as fairseq's: tests/test_sdpa.py) and fairseq's Adam
    rule over all tensors at once (``--optimizer adam_foreach``: tests/test_adam_foreach.py) where the
    regime trains with Adam; RAdam regimes keep fairseq-deepinit's per-tensor ``radam``. The CPU
    keeps the plain path of the CPU results in docs/results.md."""
    if o.device != "cuda" or not o.fast_path:
        return list(regime_flags)
    out = list(regime_flags)
    i = out.index("--optimizer") + 1
    if out[i] == "adam":
        out[i] = "adam_foreach"
    return out + ["--attention-impl", "sdpa"]


def train_command(cell: rg.Cell, o: Options) -> List[str]:
    """The exact fairseq-train command of ``cell`` (resumes from its save dir's checkpoint_last.pt)."""
    regime = cell.spec
    batch = o.max_tokens or regime.max_tokens
    per_forward, freq = est.update_freq(batch, o.max_tokens_per_job)
    # the method's flags after the sizes, so that a method may set a width (SwiGLU at equal parameters)
    cmd = fa.command("train", o.data / "bin", *fa.dims(cell.depth, o.dim, o.ffn, o.heads), *METHODS[cell.method][1])
    cmd += precision_flags(cell.method, o.device, o.precision)
    cmd += ["--share-decoder-input-output-embed"]
    cmd += ["--criterion", "label_smoothed_cross_entropy_diagnostics", "--diagnostics-interval", "0"]
    cmd += fast_path_flags(regime.flags(batch), o)
    if regime.scheduler == "reduce_lr_on_plateau":
        cmd += ["--stop-min-lr", f"{rg.STOP_MIN_LR:g}"]
    cmd += ["--max-tokens", str(per_forward), "--update-freq", str(freq), "--seed", str(cell.seed)]
    cmd += ["--max-epoch", str(o.max_epochs), "--patience", str(o.patience), "--validate-interval", "1"]
    cmd += ["--save-dir", str(o.runs / cell.dirname), "--no-epoch-checkpoints", "--save-interval", "1"]
    cmd += ["--log-format", "json", "--log-interval", str(LOG_INTERVAL)]
    cmd += ["--cpu", "--num-workers", "0"] if o.device == "cpu" else ["--num-workers", "1"]
    return cmd + shlex.split(o.extra_args)


printable = fa.printable  # a command as it is recorded (run.py, plan.py)
