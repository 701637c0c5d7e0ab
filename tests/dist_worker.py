"""One rank of ``fairseq-train`` for tests/test_distributed.py, started by ``torchrun`` on CPU (gloo).

World size, rank and ``env://`` come from torchrun's environment (the plugin adopts them on the CPU,
:mod:`fairseq_deepinit.training.launch`), as for ``torchrun ... fairseq-train``.

The worker patches two points of fairseq's :class:`~fairseq.trainer.Trainer` to record what the
tests compare across ranks, in ``$DIST_DUMP_DIR/rank<r>.pt`` after every update:

- ``state``: the model's state dict; ``updates``: the update count; ``first_ids``: the sample ids
  of the rank's first batch (so a test can show the ranks trained on different data);
- ``no_grad``: parameters that got no gradient in the last update (an unused parameter under DDP);
- ``local`` / ``pooled``: the criterion's raw diagnostics moments (``_diag|...`` keys) of the
  first update as this rank computed them, and after fairseq summed them over ranks;
- ``logged``: every ``diag_*`` scalar this rank passed to fairseq's metrics in the first update.

``--ddp-backend pytorch_ddp`` (fairseq's default) runs on CPU modules with the plugin loaded (it drops
the GPU-only ``device_ids`` fairseq passes), with the same bucketing, the same initial broadcast from
rank 0 and the same error on parameters that got no gradient as on GPUs.

``$DIST_RANK<r>_ARGS`` (split on whitespace) adds arguments to rank r only, to make one rank
behave differently from the other (e.g. inject a NaN on one rank).
"""

from __future__ import annotations

import os
import sys

import torch
from fairseq import trainer as fairseq_trainer
from fairseq.logging import metrics

RANK = int(os.environ["RANK"])
DUMP = os.path.join(os.environ["DIST_DUMP_DIR"], f"rank{RANK}.pt")
DIAG = "_diag|"
_record: dict = {"first_ids": None, "local": None, "pooled": None, "logged": {}}

_train_step = fairseq_trainer.Trainer.train_step
_aggregate = fairseq_trainer.Trainer._aggregate_logging_outputs
_log_scalar = metrics.log_scalar


def train_step(self, samples, raise_oom=False):
    if _record["first_ids"] is None:
        _record["first_ids"] = samples[0]["id"].clone()
    out = _train_step(self, samples, raise_oom)
    model = self.get_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    torch.save({**_record, "state": state, "no_grad": no_grad, "updates": self.get_num_updates()}, DUMP)
    return out


def _diag_sums(logging_outputs) -> dict:
    keys = {k for log in logging_outputs for k in log if k.startswith(DIAG)}
    return {k: sum(log[k] for log in logging_outputs if k in log).double().cpu().clone() for k in keys}


def aggregate_logging_outputs(self, logging_outputs, *extra_stats_to_sum, ignore=False):
    # only the first update that carries statistics is recorded: that is what the test compares
    record = _record["local"] is None and not ignore and any(DIAG in k for log in logging_outputs for k in log)
    if record:
        _record["local"] = _diag_sums(logging_outputs)
    out = _aggregate(self, logging_outputs, *extra_stats_to_sum, ignore=ignore)
    if record:
        _record["pooled"] = _diag_sums(out[0])
    return out


def log_scalar(key, value, *args, **kwargs):
    if key.startswith("diag_") and key not in _record["logged"] and _record["pooled"] is not None:
        _record["logged"][key] = float(value)
    return _log_scalar(key, value, *args, **kwargs)


fairseq_trainer.Trainer.train_step = train_step
fairseq_trainer.Trainer._aggregate_logging_outputs = aggregate_logging_outputs
# the criterion module imported ``metrics`` as a module, so patching the attribute reaches it
metrics.log_scalar = log_scalar

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    extra = os.environ.get(f"DIST_RANK{RANK}_ARGS", "").split()
    sys.argv = ["fairseq-train", *sys.argv[1:], *extra]
    cli_main()
