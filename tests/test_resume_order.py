"""A resumed run is the run it continues, from any point of any epoch (fairseq_deepinit/checkpoints/batch_order.py).

One uninterrupted ``fairseq-train`` run per case saves checkpoints along the way (``--save-interval-updates``
and the epoch checkpoints); runs resumed from them with ``--restore-file`` into another save dir must end with
the uninterrupted run's final checkpoint, every tensor equal (weights and optimizer state; dropout on).
Stops inside epoch 1, inside epochs 2 and 3 and exactly at an epoch boundary, with ``--update-freq 2``, for a
translation family and a language model. Stock fairseq (and the plugin without the patch) differs from the
first update after a stop past epoch 1. A resume with another ``--update-freq`` or ``--max-tokens`` logs what
changed in one line and trains on (stock fairseq: "dataloader mismatch" when the epoch now has fewer batches).
The two-rank cases are in ``tests/test_multirank.py``.

d=16, 2+2 layers (2 for the LM), 13 batches per translation epoch: each run takes seconds (forked). The
position arithmetic for another world size is checked in-process on fairseq's iterator (no process).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from test_multirank import checkpoint_tensors

from conftest import USER_DIR, run_cli

DIMS = [
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
    "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-layers", "2", "--decoder-layers", "2",
]  # fmt: skip
COMMON = [
    "--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0",
    "--disable-validation", "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--dropout", "0.1",
    "--save-interval-updates", "5",
]  # fmt: skip
FAMILIES = {
    "preln_translation": ["--task", "translation", "-s", "src", "-t", "tgt", "--arch", "preln_iwslt_de_en", *DIMS,
                          "--criterion", "cross_entropy", "--max-tokens", "1500"],
    "preln_lm": ["--task", "language_modeling", "--arch", "preln_lm_tiny", "--decoder-embed-dim", "16",
                 "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--decoder-layers", "2",
                 "--tokens-per-sample", "16", "--max-tokens", "256"],
}  # fmt: skip


def train(data: Path, family: str, save_dir: Path, max_update: int, *extra: str) -> str:
    args = [data, *COMMON, *FAMILIES[family], "--save-dir", save_dir, "--max-update", max_update, *extra]
    return run_cli("train", *args, forked=True).stdout


def assert_same_run(got: Path, want: Path) -> None:
    a, b = checkpoint_tensors(got), checkpoint_tensors(want)
    assert a.keys() == b.keys()
    differ = [k for k in b if not torch.equal(a[k], b[k])]
    worst = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ), default=0.0)
    assert differ == [], f"{len(differ)} of {len(b)} tensors differ (max {worst:.3g}): {differ[:5]}"


def resume(data: Path, family: str, tmp: Path, ref: Path, name: str, max_update: int, *extra: str) -> tuple:
    """Train from ``ref/name`` to ``max_update`` in a save dir of its own; (its final checkpoint, the log)."""
    save = tmp / f"from_{name}"
    shutil.rmtree(save, ignore_errors=True)
    log = train(data, family, save, max_update, "--restore-file", ref / name, *extra)
    return save / "checkpoint_last.pt", log


@pytest.fixture(scope="module")
def translation_ref(synthetic_bin, tmp_path_factory) -> Path:
    """40 updates, 13 batches per epoch (epochs end at 13, 26, 39): checkpoints every 5 updates and per epoch."""
    ref = tmp_path_factory.mktemp("order") / "ref"
    log = train(synthetic_bin, "preln_translation", ref, 40)
    assert "epoch 001:     13 / 13 " in log and "end of epoch 3 " in log, log[-2000:]
    return ref


@pytest.mark.parametrize(
    "stop, where",
    [("checkpoint_1_5.pt", "inside epoch 1"), ("checkpoint_2_20.pt", "inside epoch 2"),
     ("checkpoint2.pt", "at the end of epoch 2"), ("checkpoint_3_30.pt", "inside epoch 3")],
)  # fmt: skip
def test_resumed_translation_run_is_the_uninterrupted_run(synthetic_bin, translation_ref, tmp_path, stop, where):
    got, log = resume(synthetic_bin, "preln_translation", tmp_path, translation_ref, stop, 40)
    assert "Loaded checkpoint" in log and "resuming with" not in log, log[-2000:]
    assert_same_run(got, translation_ref / "checkpoint_last.pt")


def test_resume_with_update_freq_2(synthetic_bin, tmp_path):
    """7 updates per epoch (the last of each sums one batch): stops inside epoch 2 and at the end of epoch 1."""
    ref = tmp_path / "ref"
    train(synthetic_bin, "preln_translation", ref, 20, "--update-freq", "2")
    for stop in ("checkpoint_2_10.pt", "checkpoint1.pt"):
        got, _ = resume(synthetic_bin, "preln_translation", tmp_path, ref, stop, 20, "--update-freq", "2")
        assert_same_run(got, ref / "checkpoint_last.pt")


def test_resumed_language_model_run_is_the_uninterrupted_run(lm_bin, tmp_path):
    ref = tmp_path / "ref"
    log = train(lm_bin, "preln_lm", ref, 30)
    assert "end of epoch 2 " in log, log[-2000:]
    epoch_2 = sorted(p.name for p in ref.glob("checkpoint_2_*.pt"))
    assert epoch_2, sorted(p.name for p in ref.iterdir())
    for stop in (epoch_2[0], "checkpoint1.pt"):
        got, _ = resume(lm_bin, "preln_lm", tmp_path, ref, stop, 30)
        assert_same_run(got, ref / "checkpoint_last.pt")


def test_changed_batching_is_said_in_one_line_and_trains_on(synthetic_bin, translation_ref, tmp_path):
    """7 of epoch 2's 13 batches trained at update 20. ``--update-freq 2``: the same batches, two per update.
    ``--max-tokens 3000``: the epoch is cut into fewer batches than the 7 trained (stock fairseq: "Cannot resume
    training due to dataloader mismatch"); it continues at the same point of the epoch."""
    _, log = resume(synthetic_bin, "preln_translation", tmp_path, translation_ref, "checkpoint_2_20.pt", 24,
                    "--update-freq", "2")  # fmt: skip
    lines = [ln for ln in log.splitlines() if "resuming with" in ln]
    assert len(lines) == 1, log[-3000:]
    assert lines[0].endswith(
        "resuming with --update-freq 2 instead of 1: each update now sums 2 batches (1 rank x --update-freq 2, "
        "--max-tokens 1500) where the checkpoint's run summed 1 batch (1 rank x --update-freq 1, --max-tokens "
        "1500), so the updates from here on are not those of the run it continues (its learning rate was set for "
        "that batch per update); epoch 2 continues after 7 of its 13 batches, where 7 of 13 had been trained"
    ), lines[0]
    assert "Traceback" not in log and "num_updates=24," in log, log[-3000:]

    _, log = resume(synthetic_bin, "preln_translation", tmp_path, translation_ref, "checkpoint_2_20.pt", 24,
                    "--max-tokens", "3000")  # fmt: skip
    lines = [ln for ln in log.splitlines() if "resuming with" in ln]
    assert len(lines) == 1 and "resuming with --max-tokens 3000 instead of 1500: " in lines[0], log[-3000:]
    # 7 batches now: fairseq's offset 7 would leave none ("dataloader mismatch"); 7 of 13 is 3 of 7
    assert lines[0].endswith(
        "epoch 2 continues after 3 of its 7 batches (the epoch is now cut into 7 batches instead of 13), where 7 of "
        "13 had been trained"
    ), lines[0]
    assert "Traceback" not in log and "num_updates=24," in log, log[-3000:]


def _iterator(num_shards: int, shard_id: int, batches: int = 13):
    """fairseq's EpochBatchIterator over ``batches`` one-example batches, as a trainer built it (its batching)."""
    from fairseq.data import iterators

    data = list(range(batches))
    itr = iterators.EpochBatchIterator(
        torch.utils.data.TensorDataset(torch.tensor(data)), collate_fn=lambda xs: [int(x[0]) for x in xs],
        batch_sampler=[[i] for i in data], seed=1, num_shards=num_shards, shard_id=shard_id,
    )  # fmt: skip
    itr._deepinit_batching = {"world_size": num_shards, "update_freq": [1], "max_tokens": 1000, "batch_size": None}
    return itr


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (1, 2), (2, 3)])
def test_another_world_size_continues_after_the_batches_trained(old, new, caplog):
    """A checkpoint written by ``old`` ranks after 3 batches each, resumed by ``new`` ranks: every batch of the
    epoch not yet trained is trained, and fewer than ``new`` are trained twice (fairseq: each new rank skips its
    first 3 batches, so ``3 * (new - old)`` are never trained, or ``3 * (old - new)`` are trained twice)."""
    caplog.set_level(logging.INFO, logger="fairseq_deepinit.checkpoints.batch_order")
    ranks = [_iterator(old, r) for r in range(old)]
    trained = []
    for itr in ranks:
        epoch = itr.next_epoch_itr(shuffle=True)
        trained += [b for _ in range(3) for b in next(epoch)]
    state = ranks[0].state_dict()
    assert state["iterations_in_epoch"] == 3 and state["batching"]["world_size"] == old
    rest = []
    for r in range(new):
        itr = _iterator(new, r)
        itr.load_state_dict(state)
        rest += [b for batch in itr.next_epoch_itr(shuffle=True) for b in batch]
    assert sorted(set(trained) | set(rest)) == list(range(13))  # nothing skipped
    again = len(trained) + len(rest) - 13
    assert 0 <= again < new, (trained, rest)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming with")]
    assert len(lines) == new and lines[0].startswith(f"resuming with {new} ranks instead of {old}: "), lines
