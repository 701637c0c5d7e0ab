"""Reading a ``fairseq-train --log-format json`` log and judging the run: the validation curve, the train
records (per-layer gradient norms of the diagnostics criterion), the failure message, and the status
rules shared by ``deepinit-compare`` and the Multi30k matrix (``deepinit_tools/matrix``).

Status of a run (docs/results.md, "Set-up"; docs/compare.md):

- ``diverged``: a non-finite loss or gradient (the diagnostics criterion's divergence guard, fairseq's
  ``FloatingPointError``), or a non-finite validation loss;
- ``failed``: fairseq-train exited non-zero for another reason (a refused option: the plugin's one-line
  error, out of memory, ...);
- ``stalled``: the best validation nll never got below ``stall_bits`` (the unigram model's), or the
  second half of the run improved the best nll by less than ``plateau_bits``: it stopped learning;
- ``source-blind`` (the matrix only: it decodes): fewer than ``blind_fraction`` distinct greedy dev
  translations;
- else ``converging`` (``ok`` in ``deepinit-compare``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Dict, List

BLIND_FRACTION = 0.05  # fewer distinct dev translations than this share of sentences: the source is ignored
PLATEAU_BITS = 0.1  # a run whose second half gains less than this (bits/token) stopped learning

_JSON_LINE = re.compile(r"\| (train_inner|valid|train) \| (\{.*\})\s*$")
# the guard's message runs over several lines (stop, first non-finite layer, weights) before its advice
_FAILURES = (
    # the plugin prints its errors as one line (fairseq_deepinit/errors.py); a traceback with
    # FAULTHANDLER or FAIRSEQ_DEEPINIT_TRACEBACK=1 keeps the multi-line form
    re.compile(r"fairseq-deepinit: error: (.*?)(?: No checkpoint is written.*)?$", re.MULTILINE),
    re.compile(r"DivergenceError: (.*?)(?:\nNo checkpoint|$)", re.DOTALL),
    re.compile(r"FloatingPointError: (.*)"),
)
GNORM_PREFIX = "diag_gnorm/"
# a failure message that says the training went non-finite (the guard's, the plugin's for fairseq's trainer,
# fairseq's "gradients are Nan/Inf" and minimum loss scale); any other plugin error is a refusal: failed
_DIVERGENCE = re.compile(r"divergence guard|diverged|non-finite|\bnan\b|\binf\b|loss scale", re.IGNORECASE)


def is_divergence(error: str | None) -> bool:
    """Whether a failure message (``parse_log``'s ``error``) reports non-finite training."""
    return bool(error and _DIVERGENCE.search(error))


def parse_log(text: str) -> dict:
    """Validation curve ``[(update, loss, nll_loss)]``, train log records and the failure message
    of a fairseq-train ``--log-format json`` log. A validation repeated at the same update (fairseq
    validates again when an epoch ends on an interval; a resumed run validates its restart update
    again) is kept once, the first time."""
    valid: List[tuple] = []
    seen = set()
    train: List[dict] = []
    for line in text.splitlines():
        m = _JSON_LINE.search(line)
        if not m:
            continue
        rec = json.loads(m.group(2))
        if m.group(1) == "valid":
            update = int(float(rec["valid_num_updates"]))
            if update not in seen:
                seen.add(update)
                valid.append((update, float(rec["valid_loss"]), float(rec["valid_nll_loss"])))
        elif m.group(1) == "train_inner":
            train.append(rec)
    error = None
    for pattern in _FAILURES:
        m = pattern.search(text)
        if m:
            error = " ".join(m.group(1).split())
            break
    return {"valid": sorted(valid), "train": train, "error": error}


def classify(
    parsed: dict,
    returncode: int,
    stall_bits: float,
    target_bits: float | None,
    plateau_bits: float = PLATEAU_BITS,
    probe: dict | None = None,
    blind_fraction: float = BLIND_FRACTION,
) -> dict:
    """Status, best dev nll and updates to ``target_bits`` of a finished run (module docstring):
    ``diverged`` (non-finite), ``failed`` (crashed otherwise), ``stalled`` (never below ``stall_bits``,
    or the second half of the run improved the best dev nll by less than ``plateau_bits``: it stopped
    learning), ``source-blind`` (its greedy dev translations, ``probe``, are fewer than
    ``blind_fraction`` of its sentences), else ``converging``."""
    finite = [(u, nll) for u, loss, nll in parsed["valid"] if math.isfinite(loss) and math.isfinite(nll)]
    best = min(finite, key=lambda un: un[1]) if finite else None
    reached = next((u for u, nll in finite if target_bits is not None and nll <= target_bits), None)
    first_half = [nll for u, nll in finite if u <= finite[-1][0] / 2] if finite else []
    plateau = bool(first_half) and min(first_half) - best[1] < plateau_bits
    if is_divergence(parsed["error"]) or len(finite) < len(parsed["valid"]):
        status = "diverged"
    elif returncode != 0 or parsed["error"]:
        status = "failed"
    elif best is None or best[1] >= stall_bits or plateau:
        status = "stalled"
    elif probe and probe["distinct"] < blind_fraction * probe["sentences"]:
        status = "source-blind"
    else:
        status = "converging"
    return {
        "status": status,
        "best_dev_nll": best[1] if best else None,
        "best_update": best[0] if best else None,
        "updates_to_target": reached,
    }


def gnorm_at(train: List[dict], update: int | None = None) -> Dict[str, float]:
    """Per-layer gradient norms (``diag_gnorm/<layer>``) of the train record of ``update``, or of the
    last record that has them (``update`` None); ``{}`` where there is none. The first key is ``update``."""
    for rec in reversed(train):
        layers = {k[len(GNORM_PREFIX) :]: float(v) for k, v in rec.items() if k.startswith(GNORM_PREFIX)}
        at = int(float(rec["num_updates"]))
        if layers and (update is None or at == update):
            return {"update": at, **layers}
    return {}


def gnorm_profile(train: List[dict]) -> Dict[str, float]:
    """Per-layer gradient norms of the last train log record that has them."""
    return gnorm_at(train)


def last_line(text: str) -> str:
    """The last non-empty line of a log (at most 300 characters): a crashed command's error."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "no output"
