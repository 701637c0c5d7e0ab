"""A resumed run trains the batches of the run it continues, in the same order, from any point of any epoch.

fairseq 0.12.3 cuts the training set into batches once per epoch iterator: ``FairseqTask.get_batch_iterator``
(tasks/fairseq_task.py:286-318) calls ``make_batches(dataset, epoch)``, which orders the examples under
``numpy_seed(seed + epoch)`` (line 290). ``LanguagePairDataset.ordered_indices`` (data/language_pair_dataset.py:
431-438) and ``MonolingualDataset``'s (data/monolingual_dataset.py:242-246) draw a random permutation before
their stable sort by length, so that seed decides the order of equal lengths, hence which examples share a
batch. The iterator is cached (tasks/fairseq_task.py:277-279, 338) and every later epoch only reshuffles the
same batches (data/iterators.py:533-571, ``seed + epoch``). An uninterrupted run therefore trains every epoch
on the batches cut in epoch 1. A run resumed in epoch E builds its iterator there (checkpoint_utils.py:286-290
-> ``Trainer.get_train_iterator(epoch=E)``, trainer.py:693-737): from epoch 2 on the batches are cut under
``seed + E`` and the first update after the resume already sees other examples.

:func:`get_train_iterator` (wrapping ``Trainer.get_train_iterator``) builds that first iterator as fairseq
builds it in epoch 1 whenever fairseq keeps it for the later epochs, then moves it to epoch E through
fairseq's own ``load_state_dict``. Where fairseq cuts the batches anew every epoch (sharded data,
``--update-epoch-batch-itr``, a task with ``rebuild_batches``, a dataset that refuses the cache) nothing
changes: there the resumed epoch's batches are already the uninterrupted run's.

The iterator's saved state also records how the run was batched (:func:`state_dict`, under ``batching``;
fairseq's loader ignores the key). A resume with another world size, ``--update-freq``, ``--max-tokens`` or
``--batch-size`` cannot continue the same updates; :func:`load_state_dict` logs one line that says what
changed and what it means, and continues the epoch after the examples already trained (fairseq would count
the saved position in the new ranks' batches: skipping batches never trained with more ranks, training some
twice with fewer, or stopping with "dataloader mismatch" when the epoch now has fewer batches).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List

logger = logging.getLogger(__name__)

KEY = "batching"  # the key of the iterator's state that holds :func:`batching`


def _update_freq(values: Any, epoch: int) -> int:
    """``--update-freq`` of ``epoch``, as fairseq_cli/train.py:270-274 reads it."""
    values = [int(v) for v in values]
    return values[epoch - 1] if epoch <= len(values) else values[-1]


def batching(trainer: Any) -> Dict[str, Any]:
    """How ``trainer`` batches: its world size, ``--update-freq`` (the list), ``--max-tokens``, ``--batch-size``."""
    cfg = trainer.cfg
    return {
        "world_size": int(trainer.data_parallel_world_size),
        "update_freq": [int(v) for v in cfg.optimization.update_freq],
        "max_tokens": cfg.dataset.max_tokens,
        "batch_size": cfg.dataset.batch_size,
    }


def _cut_once(trainer: Any, load_dataset: bool, disable_iterator_cache: bool) -> bool:
    """Whether fairseq cuts the training batches once and keeps that iterator for every epoch (the conditions of
    tasks/fairseq_task.py:271-279 and 314-318 that can be read before the dataset is loaded), and none is cached
    yet for the loaded dataset."""
    task, subset = trainer.task, trainer.cfg.dataset.train_subset
    if disable_iterator_cache or trainer.cfg.dataset.update_epoch_batch_itr or task.has_sharded_data(subset):
        return False
    if getattr(task.cfg, "rebuild_batches", False):
        return False
    loaded = task.datasets.get(subset) if hasattr(task, "datasets") else None
    return load_dataset or loaded is None or loaded not in task.dataset_to_epoch_iter


def get_train_iterator(
    original: Callable, trainer: Any, epoch: int, combine: bool = True, load_dataset: bool = True,
    data_selector: Any = None, shard_batch_itr: bool = True, disable_iterator_cache: bool = False,
) -> Any:  # fmt: skip
    """fairseq's ``Trainer.get_train_iterator`` (trainer.py:693) whose first iterator, asked for in epoch E > 1 (a
    resume), is the one an uninterrupted run built in epoch 1 and kept (module docstring), positioned at the start
    of epoch E; the iterator remembers how the trainer batches (:func:`batching`) for its saved state."""
    rest = (combine, load_dataset, data_selector, shard_batch_itr, disable_iterator_cache)
    itr = None
    if epoch > 1 and _cut_once(trainer, load_dataset, disable_iterator_cache):
        first = original(trainer, 1, *rest)
        task = trainer.task
        if task.dataset_to_epoch_iter.get(task.dataset(trainer.cfg.dataset.train_subset)) is first:
            first.load_state_dict({"version": 2, "epoch": epoch, "iterations_in_epoch": 0})
            itr = first
        # else the dataset refused the cache (can_reuse_epoch_itr): fairseq cuts every epoch anew, as below
    if itr is None:
        itr = original(trainer, epoch, *rest)
    itr._deepinit_batching = batching(trainer)
    return itr


def state_dict(original: Callable, itr: Any) -> Dict[str, Any]:
    """fairseq's ``EpochBatchIterator.state_dict`` (data/iterators.py:441) with how the run was batched: its
    trainer's :func:`batching` and the epoch's number of batches over all ranks."""
    state = original(itr)
    record = getattr(itr, "_deepinit_batching", None)
    if record is not None:
        state[KEY] = {**record, "world_size": int(itr.num_shards), "batches": len(itr.frozen_batches)}
    return state


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _changes(saved: Dict[str, Any], now: Dict[str, Any], epoch: int) -> List[str]:
    out = []
    if saved.get("world_size") != now["world_size"]:
        out.append(f"{_ranks(now['world_size'])} instead of {saved.get('world_size')}")
    if "update_freq" in saved and _update_freq(saved["update_freq"], epoch) != _update_freq(now["update_freq"], epoch):
        out.append(f"--update-freq {_update_freq(now['update_freq'], epoch)} instead of "
                   f"{_update_freq(saved['update_freq'], epoch)}")  # fmt: skip
    for key, flag in (("max_tokens", "--max-tokens"), ("batch_size", "--batch-size")):
        if key in saved and saved[key] != now[key]:
            out.append(f"{flag} {now[key]} instead of {saved[key]}")
    return out


def _per_update(record: Dict[str, Any], epoch: int, world_size: int) -> str:
    """What one update sums under ``record`` (:func:`batching`), in words."""
    freq = _update_freq(record.get("update_freq", [1]), epoch)
    limits = "".join(
        f", {flag} {record[key]}" for key, flag in (("max_tokens", "--max-tokens"), ("batch_size", "--batch-size"))
        if record.get(key)
    )  # fmt: skip
    total = world_size * freq
    return f"{total} batch{'es' if total != 1 else ''} ({_ranks(world_size)} x --update-freq {freq}{limits})"


def load_state_dict(original: Callable, itr: Any, state: Dict[str, Any]) -> Any:
    """fairseq's ``EpochBatchIterator.load_state_dict`` (data/iterators.py:456) that says, in one line, what a
    resume with other batching changes, and continues the epoch after the examples already trained.

    Position: fairseq saves ``iterations_in_epoch`` = n, the batches each of the ``w`` ranks had trained, i.e. the
    first ``n * w`` of the epoch's ``B`` shuffled batches (``ShardedIterator``: batch k to rank k mod w). With
    ``w'`` ranks and ``B'`` batches the resumed ranks start at ``n' = floor(n * w * B' / B / w')``: nothing
    is skipped, and fewer than ``w'`` batches (when ``B' = B``) are trained twice."""
    saved, now = state.get(KEY), getattr(itr, "_deepinit_batching", None)
    if not isinstance(saved, dict) or now is None:
        return original(itr, state)
    epoch, n = int(state["epoch"]), int(state.get("iterations_in_epoch", 0))
    changes = _changes(saved, {**now, "world_size": int(itr.num_shards)}, epoch)
    old_b, new_b = int(saved.get("batches", 0)), len(itr.frozen_batches)
    old_w, new_w = int(saved.get("world_size", itr.num_shards)), int(itr.num_shards)
    if not changes and old_b == new_b:
        return original(itr, state)
    where = f"epoch {epoch} starts from its beginning"
    if n > 0 and old_b > 0:
        done = n * old_w  # the first batches of the epoch's shuffled order, trained before the checkpoint
        done_now = done * new_b // old_b
        n_now = done_now // new_w
        state = {**state, "iterations_in_epoch": n_now}
        cut = f" (the epoch is now cut into {new_b} batches instead of {old_b})" if new_b != old_b else ""
        where = f"epoch {epoch} continues after {n_now * new_w} of its {new_b} batches{cut}, where {done} of {old_b} "
        again = done_now - n_now * new_w
        where += "had been trained" + (f" ({again} of them trained again)" if again else "")
    elif new_b != old_b:
        where += f", cut into {new_b} batches instead of {old_b}"
    if changes:
        logger.info(
            f"resuming with {'; '.join(changes)}: each update now sums {_per_update(now, epoch, new_w)} where the "
            f"checkpoint's run summed {_per_update(saved, epoch, old_w)}, so the updates from here on are not those "
            f"of the run it continues (its learning rate was set for that batch per update); {where}"
        )
    else:
        logger.info(f"resuming on other training data than the checkpoint was trained on: {where}")
    return original(itr, state)
