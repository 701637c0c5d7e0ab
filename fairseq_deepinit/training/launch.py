"""Starting data-parallel ranks: torchrun on the CPU, a wrong launch refused in one line, a frozen rank timed out.

Three fairseq 0.12.3 behaviours, each replaced by one self-contained function (installed by
:mod:`fairseq_deepinit.patches`; a wrapper takes fairseq's function as its first argument):

- :func:`call_main` precedes ``distributed_utils.call_main`` (``fairseq/distributed/utils.py``, line 368),
  whose ``infer_init_method`` (line 46) adopts torchrun's environment only when
  ``--distributed-world-size`` (default: the number of CUDA devices, at least 1) is above 1, and then
  sets the device to ``RANK % torch.cuda.device_count()`` (line 91). Under torchrun on the CPU (or on
  fewer GPUs than ranks) the world size is 1, so every rank trained its own model into the same save
  folder; ``--distributed-world-size 2`` ended in ``ZeroDivisionError``; ``--distributed-init-method
  env://`` without a rank made every process rank 0 and hung. With ``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE`` and ``RANK`` all set (torchrun sets them) and no other init method given, the process
  takes world size, rank and ``env://`` from them, as fairseq does on GPUs, and the GPU
  ``RANK % devices`` only where CUDA is used; a GPU launch that already worked gets the same values.
  Refused in one line, before any work: the NCCL backend (fairseq's default) without CUDA or with
  ``--cpu``; ``env://`` with several ranks and no rank in the environment or on the command line.
- :func:`cpu_distributed_data_parallel` replaces ``DistributedDataParallel`` in
  ``fairseq/models/distributed_fairseq_model.py`` (line 60), which passes ``device_ids=[device_id]``
  even for a module on the CPU, which torch refuses: ``--ddp-backend pytorch_ddp`` (fairseq's default)
  now runs on CPU ranks. A CUDA module gets exactly fairseq's arguments.
- :func:`init_process_group` and :func:`new_group` are what ``distributed_init`` (line 273) and
  ``new_groups`` (line 412) call through their module's ``dist`` name: torch's, with a timeout. fairseq
  passes none, so a rank that stops
  answering (frozen, stopped, its host gone) holds the others in their next collective for torch's
  default (30 minutes for gloo, 10 for NCCL). With ``--heartbeat-timeout N`` (fairseq's option: "kill the
  job if no progress is made in N seconds", which fairseq checks only between forward passes, never
  inside a blocked collective) every collective and the rendezvous give up after N seconds; the rank
  that waited raises, and torchrun then ends the others.

:func:`call_main` also refuses ``--fp16`` and ``--amp`` without CUDA (:func:`check_precision`): it is the one point
before any work where fairseq-train and fairseq-hydra-train hand over the whole configuration. For a
stock model nothing changes beyond these launches and that refusal.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import re
import sys
import types
from typing import Any, Callable, Dict

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import DeepInitConfigError, RankLostError

logger = logging.getLogger(__name__)

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
_RUN: Dict[str, Any] = {}  # the running command's --heartbeat-timeout (distributed_init records it)


def torchrun_environment() -> Dict[str, str] | None:
    """torchrun's (and ``torch.distributed.launch``'s) variables when all four are set, else None."""
    if not all(k in os.environ for k in TORCHRUN_ENV):
        return None
    return {k: os.environ[k] for k in (*TORCHRUN_ENV, "LOCAL_RANK") if k in os.environ}


def _int(env: Dict[str, str], key: str) -> int:
    try:
        value = int(env[key])
    except ValueError:
        raise DeepInitConfigError(f"${key} is {env[key]!r}, not a number; start the ranks with torchrun") from None
    if value < 0:
        raise DeepInitConfigError(f"${key} is {value}; start the ranks with torchrun")
    return value


def _given_on_command_line(flag: str) -> bool:
    """Whether ``flag`` (``--distributed-rank``) or its hydra key is in this process's command line."""
    key = flag.lstrip("-").replace("-", "_")
    return any(a == flag or a.startswith(flag + "=") or key + "=" in a for a in sys.argv[1:])


def _uses_cuda(cfg: Any) -> bool:
    return torch.cuda.is_available() and not cfg.common.cpu and not getattr(cfg.common, "tpu", False)


def check_launch(cfg: Any) -> None:
    """Refuse (one line) a data-parallel launch that would fail later with a traceback or hang."""
    dt = cfg.distributed_training
    env = torchrun_environment()
    several = (env is not None and _int(env, "WORLD_SIZE") > 1) or (
        dt.distributed_init_method is not None and dt.distributed_world_size > 1
    )
    if not several or getattr(cfg.common, "tpu", False):
        return
    if dt.distributed_backend == "nccl" and not _uses_cuda(cfg):
        why = "--cpu is given" if cfg.common.cpu else "this machine has no CUDA device"
        raise DeepInitConfigError(
            f"--distributed-backend nccl (fairseq's default) needs CUDA GPUs, but {why}; add --distributed-backend "
            "gloo to train data-parallel on the CPU"
        )
    if dt.distributed_init_method == "env://" and env is None and "RANK" not in os.environ:
        if not _given_on_command_line("--distributed-rank"):
            raise DeepInitConfigError(
                f"--distributed-init-method env:// with --distributed-world-size {dt.distributed_world_size} needs "
                "each process's rank: start the ranks with torchrun (which sets RANK and WORLD_SIZE), or pass "
                "--distributed-rank R to process R; otherwise every process is rank 0 and the start hangs"
            )


# bf16 mixed precision on the CPU: the plugin's tasks with --autocast-bf16 (training/autocast.py)
CPU_BF16 = "--task translation_deepinit --autocast-bf16 for bf16 mixed precision with fp32 weights (translation)"


def check_precision(cfg: Any) -> None:
    """Refuse ``--fp16`` where fairseq's FP16Optimizer cannot keep its master weights: without CUDA it
    asks ``torch.cuda.current_device()`` for its flat fp32 copy (``fairseq/optim/fp16_optimizer.py``, line 38)
    and stops with ``AssertionError: Torch not compiled with CUDA enabled``. And ``--amp`` without CUDA: fairseq
    runs the step under ``torch.cuda.amp.autocast`` (``fairseq/tasks/fairseq_task.py``, line 531), which does
    nothing on the CPU, so the run trains in plain fp32 while it says mixed precision."""
    common = cfg.common
    if getattr(getattr(cfg, "task", None), "autocast_bf16", False):
        return  # the task refuses --autocast-bf16 next to --fp16 / --amp in its own words (training/autocast.py)
    where = "--cpu" if common.cpu else "a machine without CUDA"
    if common.fp16 and not common.memory_efficient_fp16 and not common.fp16_no_flatten_grads and not _uses_cuda(cfg):
        raise DeepInitConfigError(
            f"--fp16 on {where}: fairseq's FP16Optimizer keeps its flat fp32 master weights on a CUDA device. Train in "
            f"fp32 (drop --fp16), add --fp16-no-flatten-grads (fp16 on the CPU is slow), or use {CPU_BF16}"
        )
    if getattr(common, "amp", False) and not _uses_cuda(cfg):
        raise DeepInitConfigError(
            f"--amp on {where}: fairseq's --amp is CUDA fp16 autocast, which on the CPU trains in plain fp32. Drop "
            f"--amp, or use {CPU_BF16}"
        )


def adopt_torchrun_environment(cfg: Any) -> bool:
    """Take world size, rank and ``env://`` from torchrun's environment; True when it did.

    Only when no init method other than ``env://`` was given (an explicit ``tcp://`` launch is the
    user's); the device is fairseq's choice (``RANK % CUDA devices``) where CUDA is used, else 0.
    """
    env = torchrun_environment()
    dt = cfg.distributed_training
    if env is None or dt.distributed_init_method not in (None, "env://") or getattr(cfg.common, "tpu", False):
        return False
    world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    if world <= 1:
        return False
    if rank >= world:
        raise DeepInitConfigError(f"$RANK {rank} is not below $WORLD_SIZE {world}; start the ranks with torchrun")
    dt.distributed_init_method = "env://"
    dt.distributed_world_size = world
    dt.distributed_rank = rank
    dt.distributed_no_spawn = True  # torchrun started the processes
    dt.device_id = rank % torch.cuda.device_count() if _uses_cuda(cfg) else 0
    return True


# how torch words a peer that stopped answering (gloo, the rendezvous store, NCCL's watchdog) or went away
_TIMED_OUT = re.compile(
    r"Timed out waiting|wait timeout after|timed out after|[Ww]atchdog caught collective operation timeout"
)
_CLOSED = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")


def rank_lost_in(exc: BaseException | None) -> RankLostError | None:
    """The one-line error for a torch error (or one in its chain) saying another rank timed out or left."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RankLostError):
            return exc
        seen.add(id(exc))
        text = str(exc) if isinstance(exc, RuntimeError) else ""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        if _TIMED_OUT.search(text):
            timeout = heartbeat_timeout()
            limit = f"{timeout.total_seconds():g} s (--heartbeat-timeout)" if timeout else "torch's default timeout"
            return RankLostError(
                f"rank {rank}: another rank did not answer within {limit}: it froze, was stopped or lost its host. "
                "This rank stops (torchrun then ends the others); run the same command again to resume from the "
                "newest checkpoint"
            )
        if _CLOSED.search(text):
            return RankLostError(
                f"rank {rank}: another rank closed its connection (it stopped: its own error, if any, is printed "
                "above). This rank stops too; run the same command again to resume from the newest checkpoint"
            )
        exc = exc.__cause__ or exc.__context__
    return None


def _lost_rank_in_one_line(main: Callable) -> Callable:
    """``main`` whose end by a lost rank is :class:`RankLostError`. fairseq's heartbeat thread sends SIGINT
    at the same moment (its timeout is the collectives' one), so the KeyboardInterrupt raised while the
    timeout is handled is recognised by its context too."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return main(*args, **kwargs)
            except Exception as e:
                lost = rank_lost_in(e)
                if lost is None or lost is e:
                    raise
                raise lost from None
        except KeyboardInterrupt as e:
            lost = rank_lost_in(e.__context__)
            if lost is None:
                raise
            raise lost from None

    return run


def call_main(original: Callable, cfg: Any, main: Callable, **kwargs: Any) -> None:
    """fairseq's ``distributed_utils.call_main`` (``fairseq/distributed/utils.py``, line 368) after
    :func:`check_precision`, :func:`check_launch` and :func:`adopt_torchrun_environment`; a rank lost in
    training is one line."""
    check_precision(cfg)
    check_launch(cfg)
    adopt_torchrun_environment(cfg)
    return original(cfg, _lost_rank_in_one_line(main), **kwargs)


def heartbeat_timeout() -> datetime.timedelta | None:
    """``--heartbeat-timeout`` of the running command, when it is positive (None: torch's default)."""
    seconds = _RUN.get("heartbeat_timeout")
    return datetime.timedelta(seconds=seconds) if seconds and seconds > 0 else None


def init_process_group(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.init_process_group`` with ``timeout`` = ``--heartbeat-timeout`` when that is set."""
    timeout = heartbeat_timeout()
    if timeout is not None and kwargs.get("timeout") is None:
        kwargs["timeout"] = timeout
        logger.info(
            f"collectives and the rendezvous time out after {timeout.total_seconds():g} s (--heartbeat-timeout)"
        )
    return torch.distributed.init_process_group(*args, **kwargs)


def new_group(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` with the same timeout: fairseq's data-parallel group is one
    (``new_groups``, line 412), and torch gives a new group its default timeout, not the first group's."""
    timeout = heartbeat_timeout()
    if timeout is not None and kwargs.get("timeout") is None:
        kwargs["timeout"] = timeout
    return torch.distributed.new_group(*args, **kwargs)


def distributed_init(original: Callable, cfg: Any) -> int:
    """fairseq's ``distributed_utils.distributed_init`` (line 273), with the run's ``--heartbeat-timeout``
    recorded for :func:`init_process_group` (the config arrives here as a Namespace or a DictConfig)."""
    dt = getattr(cfg, "distributed_training", cfg)
    _RUN["heartbeat_timeout"] = getattr(dt, "heartbeat_timeout", -1)
    return original(cfg)


class _TimedDist(types.ModuleType):
    """``torch.distributed`` as fairseq's ``distributed/utils.py`` sees it: :func:`init_process_group` and
    :func:`new_group` instead of torch's, every other name torch's own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def cpu_distributed_data_parallel(module: torch.nn.Module, device_ids=None, output_device=None, **kwargs: Any):
    """torch's ``DistributedDataParallel`` as fairseq builds it (``distributed_fairseq_model.py``, line 60),
    minus the GPU-only ``device_ids`` / ``output_device`` for a module on the CPU (torch refuses them there)."""
    if all(p.device.type == "cpu" for p in module.parameters()):
        device_ids = output_device = None
    return DistributedDataParallel(module, device_ids=device_ids, output_device=output_device, **kwargs)


def timed_dist() -> types.ModuleType:
    """``torch.distributed`` with :func:`init_process_group` and :func:`new_group` (the ``dist`` that
    ``distributed_init`` and ``new_groups`` call through)."""
    timed = _TimedDist("torch.distributed")
    timed.init_process_group = init_process_group
    timed.new_group = new_group
    return timed
