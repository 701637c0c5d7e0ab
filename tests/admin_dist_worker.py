"""One rank of ``fairseq-train`` for tests/test_admin_distributed.py, started by ``torchrun``.

World size, rank and ``env://`` come from torchrun's environment, as for ``torchrun ... fairseq-train``
(the plugin adopts them on the CPU, :mod:`fairseq_deepinit.training.launch`). After every update the
rank's model state and the ids of its first batch are written to ``$ADMIN_DUMP_DIR/rank<r>.pt`` for
the test to compare across ranks.
"""

import os
import sys

import torch
from fairseq import trainer as fairseq_trainer

RANK = int(os.environ["RANK"])
DUMP = os.path.join(os.environ["ADMIN_DUMP_DIR"], f"rank{RANK}.pt")
_train_step = fairseq_trainer.Trainer.train_step
_first_ids = []


def train_step(self, samples, raise_oom=False):
    if not _first_ids:
        _first_ids.append(samples[0]["id"].clone())
    out = _train_step(self, samples, raise_oom)
    state = {k: v.detach().clone() for k, v in self.get_model().state_dict().items()}
    torch.save({"state": state, "first_ids": _first_ids[0], "updates": self.get_num_updates()}, DUMP)
    return out


fairseq_trainer.Trainer.train_step = train_step

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
