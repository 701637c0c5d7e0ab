"""Two-rank data-parallel training on CPU (gloo): what the plugin keeps per rank stays consistent.

Every test is a real ``fairseq-train`` run of two processes started by ``torchrun`` (see
tests/dist_worker.py, which records each rank's state after every update). fairseq shards the
batches of an epoch over the ranks, so the two ranks always train on different data.

- diagnostics: the criterion's statistics are computed from moments that fairseq sums over the
  ranks before :meth:`reduce_metrics` turns them into a variance/mean, so both ranks log the
  *pooled* statistic. Invariant tested: for every ``diag_var`` / ``diag_norm_in`` statistic,
  logged value == f(moments of rank 0 + moments of rank 1), which differs from f of either rank's
  own moments; it holds because the moments (count, sum, sum of squares) are additive and fairseq's
  ``_fast_stat_sync_sum`` all-reduces every logging-output key with a sum.
- MAtt and the norm-free schemes (T-Fixup, ReZero): trained with fairseq's default
  ``--ddp-backend pytorch_ddp`` and *without* ``--find-unused-parameters``, which makes DDP fail
  at the second update if any parameter got no gradient; the worker also lists such parameters
  directly. Both ranks end with bit-identical parameters.
- the divergence guard: a NaN injected on rank 1 only stops both ranks (the guard reads the
  gradients after DDP's all-reduce, so both see the same non-finite norm) with exit code 1 and
  no hang.
- ``--ddp-backend fully_sharded`` is refused at start-up (fairseq 0.12's FSDP is fairscale's,
  which is not installed and does not support the plugin's stack; docs/usage.md).
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, USER_DIR, run_cli
from fairseq_deepinit.diagnostics import depth_stats, hooks

WORKER = Path(__file__).with_name("dist_worker.py")
TIMEOUT = 120  # seconds; a run that hangs (a rank stuck in a collective) fails the test

# tiny model: the point is the parallel machinery, not the model
DIMS = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
    "--decoder-attention-heads", "2", "--share-all-embeddings",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def train_2_ranks(
    data: Path, tmp_path: Path, arch: str, *extra: str, rank_args: dict[int, str] | None = None
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run two CPU ranks of fairseq-train; return the process and each rank's last dump."""
    dump = tmp_path / "dump"
    dump.mkdir()
    cmd = [
        *torchrun(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(WORKER), str(data), "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", arch, *DIMS, "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "300", "--max-update", "3",
        "--dropout", "0.1", "--cpu", "--num-workers", "0", "--no-save", "--save-dir", str(tmp_path / "ckpt"),
        "--disable-validation", "--log-format", "simple", "--log-interval", "1", "--seed", "1",
        "--distributed-backend", "gloo", *extra,
    ]  # fmt: skip
    env = {**os.environ, "DIST_DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for rank, args in (rank_args or {}).items():
        env[f"DIST_RANK{rank}_ARGS"] = args
    # own session, so that a hang is ended with every rank, not just torchrun
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"2-rank run did not finish in {TIMEOUT} s (hang?):\n{out[-4000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out)
    dumps = [torch.load(dump / f"rank{r}.pt") if (dump / f"rank{r}.pt").exists() else None for r in (0, 1)]
    return done, dumps


def assert_trained_identically(proc: subprocess.CompletedProcess, dumps: list[dict]) -> None:
    """Both ranks did 3 updates on different batches, used every parameter, and agree bit for bit."""
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert [d["updates"] for d in dumps] == [3, 3]
    assert set(dumps[0]["first_ids"].tolist()).isdisjoint(dumps[1]["first_ids"].tolist())
    assert [d["no_grad"] for d in dumps] == [[], []], "parameters with no gradient (unused under DDP)"
    a, b = dumps[0]["state"], dumps[1]["state"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_diagnostics_are_pooled_over_ranks(synthetic_bin, tmp_path):
    proc, dumps = train_2_ranks(
        synthetic_bin, tmp_path, "preln_iwslt_de_en",
        "--criterion", "label_smoothed_cross_entropy_diagnostics", "--diagnostics-interval", "1",
        "--diagnostics-stats", "var,norm,grad,stream,logit", "--label-smoothing", "0.1",
    )  # fmt: skip
    assert_trained_identically(proc, dumps)
    # maxima over depth travel outside the summed logging outputs and are all-reduced with MAX, as
    # Megatron does for its max logit: both ranks (different batches) log the same values
    maxima = [k for k in dumps[0]["logged"] if k.startswith(("diag_max_logit/", "diag_stream_max/"))]
    assert len(maxima) == 6 + 6 + 1  # 6 attentions, the stream at 6 depths, Megatron's overall value
    assert [dumps[1]["logged"][k] for k in maxima] == [dumps[0]["logged"][k] for k in maxima]
    local = [d["local"] for d in dumps]
    assert local[0].keys() == local[1].keys() and any("|var|" in k for k in local[0])
    checked = 0
    for key in local[0]:
        kind, name = key.split("|")[1:3]
        if kind not in ("var", "norm", "stream"):
            continue
        # fairseq summed the moments over the ranks (each rank holds the same pooled sums) ...
        for d in dumps:
            assert torch.equal(d["pooled"][key], local[0][key] + local[1][key]), key
        stat = {
            "var": lambda m: hooks.residual_variances(m)["branch"],
            "norm": lambda m: hooks.norm_input_statistics(m)["mean_norm"],
            "stream": lambda m: depth_stats.stream_statistics(m)["norm"],
        }[kind]
        pooled, own = stat(local[0][key] + local[1][key]), [stat(m[key]) for m in local]
        metric = {"var": "diag_var/", "norm": "diag_norm_in/", "stream": "diag_stream_norm/"}[kind] + name
        # ... and both ranks logged the pooled statistic, which neither rank's own data gives
        assert [d["logged"][metric] for d in dumps] == [pooled, pooled], metric
        assert min(abs(pooled - o) for o in own) > 1e-9 * abs(pooled), (metric, pooled, own)
        checked += 1
    assert checked >= 2 * 2 + 2 * 3 + 6  # one var statistic per sub-layer at least, the stream at 6 depths
    # rank 0 prints it on the log line of update 1 (fairseq formats scalars with 6 significant digits)
    line = next(ln for ln in proc.stdout.splitlines() if re.search(r"\b1 / \d+ .*diag_var/", ln))
    printed = dict(re.findall(r"(diag_[\w./]+)=([-\d.e+naif]+)", line))
    for metric, value in dumps[0]["logged"].items():
        if metric.startswith(("diag_var/", "diag_norm_in/")):
            assert math.isclose(float(printed[metric]), value, rel_tol=1e-5), metric
    # per-layer gradient norms come from gradients DDP already averaged: the same on both ranks
    gnorms = [{k: v for k, v in d["logged"].items() if k.startswith("diag_gnorm/")} for d in dumps]
    assert gnorms[0] and gnorms[0] == gnorms[1]


@pytest.mark.parametrize(
    "arch",
    [
        "dsinit_matt_iwslt_de_en",  # MAtt decoder, DS-Init
        "tfixup_iwslt_de_en",  # T-Fixup: no norms at all
        "rezero_iwslt_de_en",  # ReZero: no norms, a learned alpha per sub-layer
    ],
)
def test_ddp_without_unused_parameters_keeps_ranks_identical(synthetic_bin, tmp_path, arch):
    # pytorch_ddp is fairseq's default; named here because the test is about it
    proc, dumps = train_2_ranks(synthetic_bin, tmp_path, arch, "--ddp-backend", "pytorch_ddp")
    assert_trained_identically(proc, dumps)


def test_divergence_on_one_rank_stops_both(synthetic_bin, tmp_path):
    proc, dumps = train_2_ranks(
        synthetic_bin, tmp_path, "preln_iwslt_de_en",
        "--criterion", "label_smoothed_cross_entropy_diagnostics", "--diagnostics-interval", "0",
        "--label-smoothing", "0.1", "--max-update", "5",
        rank_args={1: "--diagnostics-inject-nan 2:encoder.layers.0.fc1.weight"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-4000:]
    # rank 1 poisoned its own copy only; the all-reduced gradients carry the NaN to rank 0, so
    # each rank's guard logs its own report (rank 1's names the poisoned layer) and exits
    reports = re.findall(r"ERROR:[\w.]+:(divergence guard: training stopped at update 2:.*\n.*)", proc.stdout)
    assert len(reports) == 2, proc.stdout[-4000:]
    assert sum("first module with a NaN/Inf output: encoder.layers.0.fc1" in r for r in reports) == 1, reports
    assert "averaged over 2 data-parallel ranks: the other ranks' reports name the source" in proc.stdout
    assert [d["updates"] for d in dumps] == [1, 1]  # both stopped in update 2, neither stepped with NaN


def test_fully_sharded_is_refused_at_start_up(synthetic_bin, tmp_path):
    proc = run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", "preln_iwslt_de_en", *DIMS, "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "300",
        "--max-update", "1", "--cpu", "--no-save", "--disable-validation", "--ddp-backend", "fully_sharded",
        cwd=tmp_path, check=False, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "--ddp-backend fully_sharded is not supported" in proc.stdout, proc.stdout[-4000:]
    assert "use --ddp-backend pytorch_ddp" in proc.stdout
    # refused right after parsing: before fairseq's FSDP context (which would ask for fairscale)
    # and before the model is built (its one-line summary is never logged)
    assert "Cannot find FullyShardedDataParallel" not in proc.stdout
    assert "deepinit: init=" not in proc.stdout


def test_every_deepinit_architecture_checks_the_backend():
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    from fairseq_deepinit import patches
    from fairseq_deepinit.errors import DeepInitConfigError

    names = [n for n, cls in ARCH_MODEL_REGISTRY.items() if cls is MODEL_REGISTRY["deepinit"]]
    assert {"admin_iwslt_de_en", "dsinit_matt_iwslt_de_en_12l", "tfixup_iwslt_de_en_200l", "deepinit"} <= set(names)
    for name in names:
        with pytest.raises(DeepInitConfigError, match="pytorch_ddp"):
            ARCH_CONFIG_REGISTRY[name](Namespace(ddp_backend="fully_sharded"))
    lm_names = [n for n, cls in ARCH_MODEL_REGISTRY.items() if cls is MODEL_REGISTRY["deepinit_lm"]]
    assert patches.guard_architectures() == len(names) + len(lm_names)  # idempotent: nothing wrapped twice
    chain, fn = [], ARCH_CONFIG_REGISTRY[names[0]]
    while fn is not None:  # the wrappers around the architecture function (one: intercepts.guarded, which
        chain.append(Path(fn.__code__.co_filename).as_posix())  # patches.guard_architectures installs)
        fn = getattr(fn, "__wrapped__", None)
    assert sum(f.endswith("fairseq_deepinit/intercepts.py") for f in chain) == 1, chain
    with pytest.raises(DeepInitConfigError, match="fully_sharded"):
        MODEL_REGISTRY["deepinit"].build_model(Namespace(ddp_backend="fully_sharded"), task=None)
