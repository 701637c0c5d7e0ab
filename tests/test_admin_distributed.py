"""Admin profiling over two ranks: ``torchrun`` starts two CPU processes of fairseq-train (gloo).

Every rank profiles all ranks' first batches, merged into one batch (fairseq_deepinit/admin/gather.py),
so both ranks set the same omega and, after a few updates, hold identical parameters; and that omega is
the one a single process sets on the same batches (``--admin-profile-batches 2``), bit for bit: it does
not depend on how the batches are split over the ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, USER_DIR

WORKER = Path(__file__).with_name("admin_dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> list:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.slow
def test_two_ranks_profile_together_and_stay_identical(synthetic_bin, tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    cmd = [
        *torchrun(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(WORKER), str(synthetic_bin), "--user-dir", USER_DIR, "--task", "translation_admin", "-s", "src", "-t",
        "tgt", "--arch", "admin_iwslt_de_en", "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
        "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "300", "--max-update", "3",
        "--dropout", "0.1", "--cpu", "--num-workers", "0", "--no-save", "--save-dir", str(tmp_path / "ckpt"),
        "--disable-validation", "--log-format", "simple", "--log-interval", "1", "--seed", "1",
        "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
    ]  # fmt: skip
    env = {**os.environ, "ADMIN_DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "omega from profiling 2 batch(es) (1 per rank) (formula=code, 2 rank(s)" in proc.stdout, proc.stdout[-3000:]

    ranks = [torch.load(dump / f"rank{r}.pt") for r in (0, 1)]
    assert [r["updates"] for r in ranks] == [3, 3]
    # each rank profiled (and trained on) a different first batch ...
    assert set(ranks[0]["first_ids"].tolist()).isdisjoint(ranks[1]["first_ids"].tolist())
    # ... and still set the same omega: every parameter, omega included, is identical after 3 updates
    a, b = ranks[0]["state"], ranks[1]["state"]
    assert a.keys() == b.keys()
    omegas = [k for k in a if k.endswith(".omega")]
    assert len(omegas) == 2 * 2 + 2 * 3
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert a["encoder.layers.1.residuals.ffn.omega"].mean() > 1.0  # profiled, not the initial 1
    shutil.rmtree(dump)


@pytest.mark.slow
@pytest.mark.kernel_independent  # two runs on the same kernel path compared with each other
def test_the_profile_does_not_depend_on_the_rank_split(synthetic_bin, tmp_path):
    """Two ranks with one batch each, and one process profiling the same two batches
    (``--admin-profile-batches 2``: fairseq's rank r reads batches r, r+2, ...): the same profile, bit for
    bit. Before the ranks profiled their own batches (each padded to its own longest sentence) and summed
    the moments: 1.54 against 1.28 for encoder.layers.0.ffn (padding is counted, as released)."""
    common = [
        str(synthetic_bin), "--user-dir", USER_DIR, "--task", "translation_admin", "-s", "src", "-t", "tgt",
        "--arch", "admin_iwslt_de_en", "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16",
        "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--share-all-embeddings", "--optimizer",
        "adam", "--lr", "1e-3", "--max-tokens", "300", "--dropout", "0.1", "--cpu", "--num-workers", "0",
        "--disable-validation", "--log-format", "simple", "--seed", "1", "--admin-profile-only",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    train = Path(sys.executable).with_name("fairseq-train")
    two = [*torchrun(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(train), *common, "--distributed-backend", "gloo", "--admin-profile-path", str(tmp_path / "two.json"),
           "--save-dir", str(tmp_path / "two")]  # fmt: skip
    one = [str(train), *common, "--admin-profile-batches", "2", "--admin-profile-path", str(tmp_path / "one.json"),
           "--save-dir", str(tmp_path / "one")]  # fmt: skip
    procs = [subprocess.Popen(c, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in (two, one)]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    profiles = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("two", "one")]
    assert [p["ranks"] for p in profiles] == [2, 1]
    assert profiles[0]["source_shape"] == profiles[1]["source_shape"]  # the same merged batch
    assert profiles[0]["sublayers"] == profiles[1]["sublayers"]  # variances and omega, to the bit
    assert profiles[0]["sublayers"][1]["omega"] > 1.0
