"""Admin profiling over two ranks: ``torchrun`` starts two CPU processes of fairseq-train (gloo).

Each rank profiles its own first batch; the raw moments are summed over both ranks before omega is
computed, so both ranks set the same omega and, after a few updates, hold identical parameters.
Without the reduction their omegas would differ (different batches) and so would the parameters.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

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
        "--distributed-world-size", "2", "--distributed-init-method", "env://", "--distributed-backend", "gloo",
        "--distributed-no-spawn", "--ddp-backend", "legacy_ddp",
    ]  # fmt: skip
    env = {**os.environ, "ADMIN_DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "omega from profiling 1 batch(es) per rank (formula=code, 2 rank(s)" in proc.stdout, proc.stdout[-3000:]

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
