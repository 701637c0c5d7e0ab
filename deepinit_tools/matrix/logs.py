"""Reading a converged cell's fairseq-train log: the validation curve, tokens/s, the patience rule
and the cell's status."""

from __future__ import annotations

import json
import math
import statistics
from typing import Dict, List, Sequence, Tuple

from deepinit_tools.matrix.cells import parse_log
from deepinit_tools.matrix.commands import _EARLY_LR, _EARLY_PATIENCE, _TRAIN, _VALID
from deepinit_tools.matrix.common import BLIND_FRACTION
from fairseq_deepinit.compare.verdict import is_divergence


def valid_curve(text: str) -> List[Tuple[int, float, float, int]]:
    """``[(epoch, dev loss, dev nll, updates)]`` of a fairseq-train json log, one per epoch (the
    last record wins: a run killed between validation and checkpoint validates that epoch again)."""
    by_epoch: Dict[int, Tuple[int, float, float, int]] = {}
    for line in text.splitlines():
        m = _VALID.search(line)
        if m:
            r = json.loads(m.group(1))
            e = int(r["epoch"])
            by_epoch[e] = (e, float(r["valid_loss"]), float(r["valid_nll_loss"]), int(float(r["valid_num_updates"])))
    return [by_epoch[e] for e in sorted(by_epoch)]


def train_wps(text: str) -> float | None:
    """Median target tokens/s over the epochs (fairseq's epoch-level ``train_wps``)."""
    wps = [float(json.loads(m.group(1))["train_wps"]) for m in map(_TRAIN.search, text.splitlines()) if m]
    return round(statistics.median(wps)) if wps else None


def plateaued(curve: Sequence[Tuple], patience: int) -> bool:
    """True when the last ``patience`` validations did not improve the best dev loss (fairseq's
    ``--patience`` rule, lower is better, strict improvement)."""
    losses = [c[1] for c in curve]
    if patience <= 0 or len(losses) <= patience:
        return False
    best_before = min(losses[:-patience])
    return all(not (x < best_before) for x in losses[-patience:])


def classify(
    curve: Sequence[Tuple],
    text: str,
    returncode: int,
    patience: int,
    stall_bits: float,
    probe: dict | None,
    blind_fraction: float = BLIND_FRACTION,
) -> Tuple[str, str]:
    """(status, stop reason) of a finished cell; see the module docstring."""
    error = parse_log(text)["error"]
    finite = [c for c in curve if math.isfinite(c[1]) and math.isfinite(c[2])]
    stop = "patience" if _EARLY_PATIENCE in text else "min-lr" if _EARLY_LR in text else "epoch-cap"
    if is_divergence(error) or len(finite) < len(curve):
        return "diverged", "error"
    if returncode != 0 or error:
        return "failed", "error"
    if not finite or min(c[2] for c in finite) >= stall_bits:
        return "stalled", stop
    if probe and probe["distinct"] < blind_fraction * probe["sentences"]:
        return "source-blind", stop
    if stop != "epoch-cap" or plateaued(finite, patience):
        return "converged", stop if stop != "epoch-cap" else "patience"
    return "capped", stop
