"""Data-parallel start-up and the resume broadcast, in process (the 2-rank runs: tests/test_multirank.py).

- fairseq_deepinit/training/launch.py: torchrun's environment adopted (world size, rank, ``env://``, the
  device only where CUDA is used), a launch that would fail or hang refused in one line (NCCL without
  CUDA, ``env://`` without a rank, ``--fp16`` without CUDA), ``--heartbeat-timeout`` handed to
  ``init_process_group`` and ``new_group``, torch's timeout and lost-peer errors turned into one line;
- fairseq_deepinit/checkpoints/broadcast.py: the buffer rank 0 broadcasts on resume (a real fairseq
  checkpoint state: omegaconf config, fairseq's tensor placeholders) is refused by fairseq's bare
  ``torch.load`` under torch >= 2.6 and taken by the plugin's receiving side, through fairseq's own
  ``_broadcast_object_slow`` (its collective replaced by the bytes); the file allow-list is unchanged
  afterwards, a checkpoint *file* that pickles a ``DictConfig`` is still refused, and a hostile buffer
  is refused in one line without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.distributed import utils as distributed_utils
from omegaconf import OmegaConf

from fairseq_deepinit import errors
from fairseq_deepinit.checkpoints import broadcast
from fairseq_deepinit.training import launch

FIXTURE = Path(__file__).with_name("fixtures") / "v010" / "postln.pt"


def config(**over) -> OmegaConf:
    """The parts of fairseq's config the launch reads, with fairseq's defaults on a machine without CUDA."""
    dt = {"distributed_world_size": 1, "distributed_rank": 0, "distributed_backend": "nccl", "device_id": 0,
          "distributed_init_method": None, "distributed_no_spawn": False, "heartbeat_timeout": -1}  # fmt: skip
    common = {"cpu": True, "tpu": False, "fp16": False, "memory_efficient_fp16": False, "fp16_no_flatten_grads": False}
    for key, value in over.items():
        (dt if key in dt else common)[key] = value
    return OmegaConf.create({"distributed_training": dt, "common": common})


TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}


@pytest.fixture
def torchrun_env(monkeypatch):
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)


def test_torchrun_environment_is_adopted_on_the_cpu(torchrun_env):
    cfg = config(distributed_backend="gloo")
    launch.check_launch(cfg)
    assert launch.adopt_torchrun_environment(cfg) is True
    dt = cfg.distributed_training
    assert (dt.distributed_world_size, dt.distributed_rank, dt.distributed_init_method) == (2, 1, "env://")
    assert dt.distributed_no_spawn is True and dt.device_id == 0  # no CUDA: fairseq's RANK % devices is skipped


def test_an_explicit_tcp_launch_and_a_single_process_are_left_alone(torchrun_env, monkeypatch):
    cfg = config(distributed_backend="gloo", distributed_init_method="tcp://h:1")
    assert launch.adopt_torchrun_environment(cfg) is False and cfg.distributed_training.distributed_rank == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    cfg = config()
    launch.check_launch(cfg)  # one process: nccl is never used, nothing to refuse
    assert launch.adopt_torchrun_environment(cfg) is False
    assert cfg.distributed_training.distributed_init_method is None


@pytest.mark.parametrize(
    "over, env, message",
    [
        ({}, TORCHRUN, "--distributed-backend nccl (fairseq's default) needs CUDA GPUs, but --cpu is given; add "
         "--distributed-backend gloo"),
        ({"distributed_backend": "gloo", "distributed_init_method": "env://", "distributed_world_size": 2}, {},
         "--distributed-init-method env:// with --distributed-world-size 2 needs each process's rank"),
        ({"fp16": True}, {}, "--fp16 on --cpu: fairseq's FP16Optimizer keeps its flat fp32 master weights on a CUDA "
         "device"),
        ({"distributed_backend": "gloo"}, {**TORCHRUN, "RANK": "2"}, "$RANK 2 is not below $WORLD_SIZE 2"),
        ({"distributed_backend": "gloo"}, {**TORCHRUN, "WORLD_SIZE": "two"}, "$WORLD_SIZE is 'two', not a number"),
    ],
)  # fmt: skip
def test_launches_that_would_fail_or_hang_are_one_line(monkeypatch, over, env, message):
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("sys.argv", ["fairseq-train", "data"])
    started = []
    monkeypatch.setitem(launch._ORIGINAL, "call_main", lambda cfg, main, **kw: started.append(cfg))
    with pytest.raises(errors.DeepInitConfigError) as info:
        launch.call_main(config(**over), main=lambda cfg: None)
    assert message in errors.format_error(info.value)
    assert started == []  # refused before fairseq starts anything


def test_env_init_with_a_rank_on_the_command_line_is_accepted(monkeypatch):
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("sys.argv", ["fairseq-train", "data", "--distributed-rank", "1"])
    launch.check_launch(config(distributed_backend="gloo", distributed_init_method="env://", distributed_world_size=2))


def test_heartbeat_timeout_reaches_every_process_group(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: calls.append(("init", kw)))
    monkeypatch.setattr(torch.distributed, "new_group", lambda *a, **kw: calls.append(("group", kw)))
    monkeypatch.setitem(launch._ORIGINAL, "distributed_init", lambda cfg: (distributed_utils.dist.init_process_group(
        backend="gloo"), distributed_utils.dist.new_group([0, 1]), 0)[-1])  # fmt: skip
    launch.distributed_init(config(heartbeat_timeout=7))
    assert calls == [("init", {"backend": "gloo", "timeout": datetime.timedelta(seconds=7)}),
                     ("group", {"timeout": datetime.timedelta(seconds=7)})]  # fmt: skip
    calls.clear()
    launch.distributed_init(config())  # -1: torch's own default
    assert calls == [("init", {"backend": "gloo"}), ("group", {})]
    assert distributed_utils.dist.all_reduce is torch.distributed.all_reduce  # every other name is torch's


def test_a_lost_rank_is_one_line():
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation")
    lost = launch.rank_lost_in(timed_out)
    assert lost is not None and "another rank did not answer within" in str(lost)
    try:  # fairseq's heartbeat SIGINT arrives while the timeout is being handled
        try:
            raise timed_out
        except RuntimeError:
            raise KeyboardInterrupt  # noqa: B904
    except KeyboardInterrupt as interrupt:
        assert launch.rank_lost_in(interrupt.__context__) is not None
    closed = launch.rank_lost_in(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    assert closed is not None and "another rank closed its connection" in str(closed)
    assert launch.rank_lost_in(RuntimeError("CUDA out of memory")) is None

    def timing_out_main(cfg):
        raise timed_out

    with pytest.raises(errors.RankLostError):
        launch._lost_rank_in_one_line(timing_out_main)(None)


def test_cpu_ddp_drops_the_gpu_device_ids(monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "DistributedDataParallel", lambda module, **kw: seen.update(kw) or module)
    launch.cpu_distributed_data_parallel(torch.nn.Linear(2, 2), device_ids=[0], output_device=0, bucket_cap_mb=25)
    assert seen == {"device_ids": None, "output_device": None, "bucket_cap_mb": 25}


# --- the resume broadcast ---------------------------------------------------------------------------------------


def broadcast_buffer(state: dict) -> bytes:
    """What fairseq's rank 0 sends: the state with its tensors taken out, ``torch.save``-d (utils.py:776, 797)."""
    buffer = io.BytesIO()
    torch.save(distributed_utils._split_tensors_from_obj(state, []), buffer)
    return buffer.getvalue()


def receive(monkeypatch, payload: bytes, receiver):
    """fairseq's receiving rank of ``_broadcast_object_slow``: its two broadcasts deliver ``payload``."""

    def fake_broadcast(tensor, src, group):
        if tensor.dtype == torch.long:
            tensor.fill_(len(payload))
        else:
            tensor.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    monkeypatch.setattr(distributed_utils, "broadcast", fake_broadcast)
    monkeypatch.setattr(distributed_utils, "get_rank", lambda group: 1)
    monkeypatch.setattr(distributed_utils, "get_global_rank", lambda: 1)
    return receiver(None, 0, None, torch.device("cpu"))


def test_the_resume_broadcast_is_taken_without_widening_the_file_allow_list(monkeypatch, tmp_path):
    state = checkpoint_utils.load_checkpoint_to_cpu(str(FIXTURE))  # rank 0's safe load: cfg is a DictConfig now
    payload = broadcast_buffer(state)
    before = set(torch.serialization.get_safe_globals())
    with pytest.raises(pickle.UnpicklingError, match="omegaconf"):  # fairseq's own receiving side (the failure)
        receive(monkeypatch, payload, broadcast._ORIGINAL["_broadcast_object_slow"])
    got = receive(monkeypatch, payload, distributed_utils._broadcast_object_slow)  # the plugin's
    assert OmegaConf.is_config(got["cfg"]) and got["cfg"].model.arch == state["cfg"].model.arch
    assert isinstance(got["model"]["encoder.embed_tokens.weight"], distributed_utils._TensorPlaceholder)
    assert set(torch.serialization.get_safe_globals()) == before  # argparse.Namespace still allowed, nothing added
    # a checkpoint FILE that pickles a DictConfig is still refused
    bad = tmp_path / "dictconfig.pt"
    torch.save({"model": {}, "cfg": OmegaConf.create({"model": {"arch": "x"}})}, bad)
    with pytest.raises(errors.UnsafeCheckpointError, match="omegaconf.dictconfig.DictConfig"):
        checkpoint_utils.load_checkpoint_to_cpu(str(bad))


class Payload:
    def __reduce__(self):
        return (os.system, ("touch ran",))


def test_a_hostile_broadcast_is_one_line_and_runs_nothing(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    buffer = io.BytesIO()
    torch.save({"cfg": Payload()}, buffer)
    with pytest.raises(errors.CheckpointFileError) as info:
        receive(monkeypatch, buffer.getvalue(), distributed_utils._broadcast_object_slow)
    line = errors.format_error(info.value)
    assert "rank 1 could not take the checkpoint state rank 0 loaded" in line and "\n" not in line
    assert "--load-checkpoint-on-all-dp-ranks" in line and "weights_only=False" not in line
    assert not (tmp_path / "ran").exists()


def test_broadcast_globals_are_types_only():
    """Everything the broadcast adds is a class (a container, a node, a placeholder) or typing.Any: nothing
    that runs a command when unpickled."""
    assert argparse.Namespace not in broadcast._added_globals()
    for g in broadcast.BROADCAST_GLOBALS:
        assert isinstance(g, type) or g is __import__("typing").Any, g
