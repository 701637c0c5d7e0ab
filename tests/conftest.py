"""Shared test fixtures: the checkout's plugin, fairseq CLIs as subprocesses, small corpora.

Every CLI call passes ``--user-dir`` as the absolute path of *this checkout's* package, so tests
never exercise a stale installed copy. Corpora are built by the tests themselves:

- :func:`synthetic_corpus`: a deterministic, learnable toy translation task (reverse + shift),
  independent of any data on disk;
- :func:`multi30k_bin`: the first lines of Multi30k de-en read in place from
  ``../shared/data/multi30k`` (skipped, with the reason, where that folder is absent).
- :func:`lm_bin`: a tiny monolingual corpus for the language-model tests.
"""

from __future__ import annotations

import gzip
import itertools
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import cli_fork
import pytest
from cli_fork import run_forked

from deepinit_tools.harness.tiny import TINY_DIMS, make_dictionary, tiny_batch, tiny_sample, tiny_trainer  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_deepinit")
MULTI30K = Path(os.environ.get("MULTI30K_DIR", REPO.parent / "shared" / "data" / "multi30k"))


def run_cli(
    tool: str,
    *args: str,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
    env: dict | None = None,
    timeout: int = 600,
    forked: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``fairseq-<tool>`` (train, generate, preprocess, interactive) in a subprocess.

    Returns the completed process (stdout and stderr merged into ``.stdout``); on failure with
    ``check`` the assertion shows the command and the tail of its output. ``forked``: in a process forked
    from a server that has imported fairseq (``tests/cli_fork.py``), which saves fairseq's ~4 s import;
    for runs that must succeed (a failing command's one-line error needs the real interpreter's exit).
    """
    if forked:
        assert check and cwd is None and env is None, "forked runs are checked and take no cwd or env"
        fd, log = tempfile.mkstemp(prefix=f"fairseq-{tool}-", suffix=".log")
        os.close(fd)
        try:
            return run_forked(tool, *args, log=log, timeout=timeout)
        finally:
            os.unlink(log)
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    full_env.update(env or {})
    proc = subprocess.run(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc


def not_one_line(results: dict, expected: dict) -> list:
    """The probes of ``results`` (name -> finished process, stdout and stderr together) that did not end in exit
    status 1 with exactly one ``fairseq-deepinit: error:`` line holding ``expected[name]`` and no traceback."""
    from fairseq_deepinit.errors import PREFIX

    failed = []
    for name, proc in results.items():
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
        ok = proc.returncode == 1 and "Traceback" not in proc.stdout and len(lines) == 1 and expected[name] in lines[0]
        if not ok:
            failed.append(f"{name}: status {proc.returncode}\n{proc.stdout[-1500:]}")
    return failed


def run_script(script: str | os.PathLike, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python <script> args...`` (a benchmark script) with one torch thread, stdout and stderr merged into
    ``.stdout``; asserts exit status 0, showing the output's tail otherwise."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc


def write_synthetic_corpus(
    folder: Path, n_train: int = 2000, n_valid: int = 100, n_test: int = 100, vocab: int = 40, seed: int = 0
) -> Path:
    """A toy translation task: target = reversed source with every token id shifted by one.

    Learnable by any working model in a few hundred updates, so it tells a broken model from a
    working one; writes ``{train,valid,test}.{src,tgt}`` and returns ``folder``.
    """
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        with open(folder / f"{split}.src", "w") as fs, open(folder / f"{split}.tgt", "w") as ft:
            for _ in range(n):
                toks = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
                fs.write(" ".join(f"w{t}" for t in toks) + "\n")
                ft.write(" ".join(f"w{(t + 1) % vocab}" for t in reversed(toks)) + "\n")
    return folder


def preprocess(raw: Path, dest: Path, src: str, tgt: str, test: bool = True, extra: tuple = ()) -> Path:
    args = [
        "--source-lang",
        src,
        "--target-lang",
        tgt,
        "--trainpref",
        raw / "train",
        "--validpref",
        raw / "valid",
        "--destdir",
        dest,
        "--workers",
        "1",
        *extra,
    ]
    if test:
        args += ["--testpref", raw / "test"]
    run_cli("preprocess", *args)
    return dest


@pytest.fixture(scope="session")
def synthetic_bin(tmp_path_factory) -> Path:
    """Binarised synthetic corpus (src -> tgt), shared by every test of the session."""
    root = tmp_path_factory.mktemp("synthetic")
    raw = write_synthetic_corpus(root / "raw")
    return preprocess(raw, root / "bin", "src", "tgt", extra=("--joined-dictionary",))


def read_multi30k(split: str, lang: str, limit: int | None = None) -> list[str]:
    """Lower-cased lines of a Multi30k split, read in place (never copied into the project)."""
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.strip().lower() for line in itertools.islice(f, limit)]


def write_multi30k_gz(root: Path, sizes: dict) -> Path:
    """The first ``sizes[split]`` lines of Multi30k splits, gzip, in Multi30k's own file names (a small
    ``MULTI30K_DIR``); skips the test where Multi30k is not found."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    root.mkdir(parents=True, exist_ok=True)
    for split, n in sizes.items():
        for lang in ("de", "en"):
            with gzip.open(root / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(read_multi30k(split, lang, n)) + "\n")
    return root


@pytest.fixture(scope="session")
def multi30k_bin(tmp_path_factory) -> Path:
    """The first 3000 training and 200 validation sentences of Multi30k de-en, word level."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    root = tmp_path_factory.mktemp("multi30k")
    raw = root / "raw"
    raw.mkdir()
    for split, out, n in (("train", "train", 3000), ("val", "valid", 200), ("test_2016_flickr", "test", 200)):
        for lang in ("de", "en"):
            (raw / f"{out}.{lang}").write_text("\n".join(read_multi30k(split, lang, n)) + "\n", encoding="utf-8")
    return preprocess(raw, root / "bin", "de", "en", extra=("--thresholdsrc", "2", "--thresholdtgt", "2"))


@pytest.fixture(scope="session")
def lm_bin(tmp_path_factory):
    """A tiny monolingual corpus: sequences w_a, w_(a+k), w_(a+2k), ... (mod 30), binarised; shared by every
    language-model test of the session."""
    root = tmp_path_factory.mktemp("lm")
    rng = random.Random(0)
    for split, n in (("train", 300), ("valid", 30), ("test", 30)):
        lines = []
        for _ in range(n):
            a, k = rng.randrange(30), rng.choice((1, 2, 3))
            lines.append(" ".join(f"w{(a + k * i) % 30}" for i in range(rng.randint(4, 12))))
        (root / f"{split}.txt").write_text("\n".join(lines) + "\n")
    run_cli("preprocess", "--only-source", "--trainpref", root / "train.txt", "--validpref", root / "valid.txt",
            "--testpref", root / "test.txt", "--destdir", root / "bin", "--workers", "1")  # fmt: skip
    return root / "bin"


def build_model(arch: str = "deepinit_tiny", *cli: str, n_symbols: int = 50, seed: int = 1):
    """Build a ``deepinit`` (or stock fairseq) model in-process exactly as fairseq-train would.

    ``cli`` are extra fairseq-train model flags (``"--init-scheme", "t-fixup"``); returns
    ``(model, args)`` with ``args`` the resolved namespace. Seeds torch first, so two calls with the
    same seed and dims give the same pre-scheme weights.
    """
    import torch
    from fairseq import options, tasks
    from fairseq.tasks.translation import TranslationTask

    import fairseq_deepinit  # noqa: F401  (registers the model)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["/nonexistent", "--task", "translation", "--arch", arch, "-s", "src", "-t", "tgt", *cli]
    )
    d = make_dictionary(n_symbols)
    task = TranslationTask(args, d, d)
    torch.manual_seed(seed)
    model = task.build_model(args) if hasattr(task, "build_model") else tasks.setup_task(args).build_model(args)
    return model, args


def perturb_norms(model, seed: int = 5) -> None:
    """Norm gains and biases away from 1 and 0, so that a norm applied in the wrong place shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g).to(p.dtype))


def padded_tokens(bsz: int, length: int, seed: int, pad_first_row: int = 0, pad: int = 1):
    """Random token ids in [4, 50) of shape ``(bsz, length)``, the first row's first ``pad_first_row`` positions
    padding (left padding, as fairseq's source side)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.randint(4, 50, (bsz, length), generator=g)
    t[0, :pad_first_row] = pad
    return t


def assert_beam_decoding_is_the_full_forward(model, lm: bool, tol: dict, pad: int = 1) -> None:
    """As fairseq's SequenceGenerator: 2 sentences x beam 2 (a translation model's source repeated per beam), the
    beams reordered within each sentence at steps 2 and 4; every incremental step's output equals the full
    forward of its prefix within ``tol``."""
    import torch

    bsz, steps = 4, 6
    orders = {2: torch.tensor([1, 1, 2, 3]), 4: torch.tensor([0, 0, 3, 2])}
    nxt = padded_tokens(bsz, steps, 9)
    enc = None
    if not lm:
        src = padded_tokens(2, 7, 10, pad_first_row=3, pad=pad).repeat_interleave(2, dim=0)
        enc = model.encoder(src, src_lengths=src.ne(pad).sum(1))
    state: dict = {}
    prefix = torch.full((bsz, 0), 2, dtype=torch.long)
    with torch.no_grad():
        for t in range(steps):
            if t in orders:
                model.decoder.reorder_incremental_state_scripting(state, orders[t])
                prefix = prefix[orders[t]]
                if enc is not None:
                    enc = model.encoder.reorder_encoder_out(enc, orders[t])
            prefix = torch.cat([prefix, nxt[:, t : t + 1]], dim=1)
            step = model.decoder(prefix, encoder_out=enc, incremental_state=state)[0][:, -1]
            full = model.decoder(prefix, encoder_out=enc)[0][:, -1]
            torch.testing.assert_close(step, full, **tol)


# Modules whose tests compare floating-point results (closed forms, two implementations, trained
# models): scripts/test.sh runs them a second time on another CPU kernel path (ATEN_CPU_CAPABILITY,
# MKL_ENABLE_INSTRUCTIONS), so that a tolerance tuned to one machine's kernels fails in CI. A test of
# such a module marked ``kernel_independent`` (an end-to-end CLI run checked by exact or structural
# assertions) runs once. test_golden is not here: its bit-exact outputs are checked only on the fixture's
# kernel path (skipped on any other) and its state-dict keys and parameter order depend on no kernel.
NUMERIC_MODULES = {
    "test_adam_foreach",
    "test_admin",
    "test_admin_distributed",
    "test_attention_features",
    "test_attn_res",
    "test_autocast",
    "test_cli",
    "test_compat_v010",
    "test_deep",
    "test_depth_diagnostics",
    "test_depth_mup",
    "test_depth_mup_wiring",
    "test_diagnostics",
    "test_dyt",
    "test_dyt_model",
    "test_export",
    "test_export_hf",
    "test_hooks",
    "test_hyper_connections",
    "test_kernels",
    "test_lm",
    "test_lnscale",
    "test_matt",
    "test_mixln",
    "test_muon",
    "test_norm_placement",
    "test_norms",
    "test_ports",
    "test_ports_2025",
    "test_precision",
    "test_qk_clip",
    "test_qk_norm",
    "test_radam",
    "test_resi_dual",
    "test_schedule",
    "test_schemes",
    "test_sdpa",
    "test_softcap",
    "test_successors",
    "test_swiglu",
    "test_very_deep",
    "test_z_loss",
    "test_zc_rmsnorm",
}


TRAIN_2 = ["--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0", "--log-format", "simple",
           "--log-interval", "1", "--seed", "1", "--max-update", "2"]  # fmt: skip


def train_and_reload(data: Path, save_dir: Path, *argv) -> tuple:
    """``(log, model)``: 2 updates of fairseq-train on ``data`` (translation src->tgt, no validation), then the
    saved ``checkpoint_last.pt`` loaded by fairseq's loader, every tensor equal to the saved one."""
    import torch
    from fairseq import checkpoint_utils

    log = run_cli("train", data, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt", *argv,
                  "--max-tokens", "500", *TRAIN_2, "--save-dir", save_dir, "--no-epoch-checkpoints",
                  "--disable-validation", forked=True).stdout  # fmt: skip
    ckpt = save_dir / "checkpoint_last.pt"
    saved = torch.load(ckpt, map_location="cpu")["model"]
    (model,), _ = checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"data": str(data)})
    assert set(model.state_dict()) == set(saved)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    return log, model


def generate_test(data: Path, checkpoint: Path) -> str:
    """fairseq-generate's output on ``data``'s test split (translation src->tgt, beam 3, at most 10 words)."""
    return run_cli(
        "generate", data, "--user-dir", USER_DIR, "--path", checkpoint, "--task", "translation", "-s", "src", "-t",
        "tgt", "--gen-subset", "test", "--beam", "3", "--batch-size", "64", "--required-batch-size-multiple", "1",
        "--max-len-b", "10", "--cpu", "--num-workers", "0", forked=True,
    ).stdout  # fmt: skip


def train_tiny_lm(data: Path, save_dir: Path, arch: str) -> str:
    """fairseq-train's output: 3 updates of ``arch`` (3 layers) as a language model on ``data``, nothing saved."""
    return run_cli(
        "train", data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", arch,
        "--tokens-per-sample", "32", "--max-tokens", "256", "--optimizer", "adam", "--lr", "2e-3",
        "--num-workers", "0", "--cpu", "--log-format", "simple", "--log-interval", "1", "--seed", "1",
        "--decoder-layers", "3", "--max-update", "3", "--no-save", "--disable-validation", "--save-dir", save_dir,
        forked=True,
    ).stdout  # fmt: skip


# The slow tier (CI; left out by ``pytest -m "not slow"``): every test of these modules (fairseq's CLI
# pipelines, distributed runs, the tools, scripts, benchmarks and recipes, GPU readiness through the
# tools' counters and torch.compile), every test that uses a
# binarised corpus (``CLI_FIXTURES``: fairseq-preprocess, then fairseq's CLI), and tests marked
# ``@pytest.mark.slow``. A test outside it that starts Python, a shell script or fairseq fails and says so
# (``_fast_tests_start_no_process``), so a new test cannot slip into the fast tier by mistake.
SLOW_MODULES = {
    "test_admin_distributed",
    "test_benchmarks",
    "test_cli",
    "test_converge",
    "test_distributed",
    "test_gpu_readiness",
    "test_gpu_session",
    "test_gpu_smoke",
    "test_hydra",
    "test_lm_study",
    "test_multi30k_matrix",
    "test_quickstart",
    "test_recipes",
    "test_tensorboard",
    "test_tools",
}
CLI_FIXTURES = {"synthetic_bin", "multi30k_bin", "lm_bin"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in NUMERIC_MODULES and item.get_closest_marker("kernel_independent") is None:
            item.add_marker(pytest.mark.numerics)
        if module in SLOW_MODULES or CLI_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


_STARTERS = ("python", "bash", "sh", "torchrun", "fairseq-", "deepinit-")


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch) -> None:
    """Outside the slow tier, starting Python, a shell or fairseq (``subprocess``, the fork server) fails."""
    if request.node.get_closest_marker("slow") is not None:
        return
    refusal = f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow (or its module in SLOW_MODULES)"
    real = subprocess.Popen

    class Refusing(real):
        def __init__(self, args, *rest, **kwargs):
            program = os.path.basename(str(args[0] if isinstance(args, (list, tuple)) else args).split()[0])
            if program.startswith(_STARTERS) or program.endswith(".sh"):
                raise AssertionError(f"{refusal}: {program}")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Refusing)
    monkeypatch.setattr(cli_fork, "REFUSAL", refusal)
