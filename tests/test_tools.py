"""The scripts around the plugin: where Multi30k comes from (``scripts/multi30k_data.py``), the
translation progress filter (``scripts/generate_progress.py``) and every command line's ``--help``.

Nothing here touches the network: downloads go to ``file://`` URLs or through an injected opener."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest

from conftest import REPO, TINY_DIMS, USER_DIR, run_cli
from deepinit_tools import generate_progress as gp  # noqa: E402
from deepinit_tools import hf_tokenizer_check as htc  # noqa: E402
from deepinit_tools import multi30k as md  # noqa: E402
from deepinit_tools import multi30k_matrix as mm  # noqa: E402
from deepinit_tools import prepare_bible  # noqa: E402
from deepinit_tools import train_progress as tp  # noqa: E402

# ---- Multi30k: given folder, local copy, pinned download --------------------------------------


def fake_release(folder: Path) -> dict:
    """Small gzip files under Multi30k's names (synthetic text, no corpus copied); their sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    sums = {}
    for i, name in enumerate(md.SHA256):
        data = gzip.compress(f"line {i} of {name}\n".encode() * 3, mtime=0)
        (folder / name).write_bytes(data)
        sums[name] = hashlib.sha256(data).hexdigest()
    return sums


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No MULTI30K_DIR, no local copy, and a network that fails the test if anything opens a URL."""
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    monkeypatch.setattr(md, "LOCAL_DEFAULT", tmp_path / "no-local-copy")
    monkeypatch.setattr(md, "CACHE", tmp_path / "cache")

    def no_network(url, timeout=None):
        raise AssertionError(f"unexpected download of {url}")

    monkeypatch.setattr(md.urllib.request, "urlopen", no_network)
    return tmp_path


def test_pinned_release_is_a_fixed_commit_with_every_file_hashed():
    assert re.fullmatch(r"[0-9a-f]{40}", md.COMMIT) and md.COMMIT in md.BASE_URL
    assert md.BASE_URL.startswith("https://raw.githubusercontent.com/multi30k/dataset/")
    assert set(md.SPLITS.values()) == {name.split(".")[0] for name in md.SHA256}  # every split the driver reads
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in md.SHA256.values()) and len(md.SHA256) == 8


def test_given_folder_wins_and_a_folder_without_the_files_says_what_to_do(offline, monkeypatch):
    given = offline / "mine"
    fake_release(given)
    fake_release(offline / "no-local-copy")  # present, but the given folder comes first
    assert md.locate(given) == given
    monkeypatch.setenv("MULTI30K_DIR", str(given))
    assert md.locate() == given
    (given / "val.en.gz").unlink()
    with pytest.raises(md.Multi30kError, match=r"has no val\.en\.gz: point it at .* or unset it"):
        md.locate()


def test_local_copy_is_used_when_complete(offline):
    local = offline / "no-local-copy"
    fake_release(local)
    assert md.locate() == local


def test_download_from_a_file_url_checks_hashes_and_is_cached(offline, monkeypatch):
    release = offline / "release"
    monkeypatch.setattr(md, "SHA256", fake_release(release))
    got = md.locate(base_url=release.as_uri(), opener=md.urllib.request.build_opener().open)
    assert got == offline / "cache"
    for name in md.SHA256:
        assert (got / name).read_bytes() == (release / name).read_bytes()
    assert not list(got.glob("*.part"))
    # second call: everything cached and verified, nothing opened (the fixture's opener would fail)
    assert md.locate() == got
    # a damaged cached file is fetched again
    (got / "train.de.gz").write_bytes(b"truncated")
    md.locate(base_url=release.as_uri(), opener=md.urllib.request.build_opener().open)
    assert (got / "train.de.gz").read_bytes() == (release / "train.de.gz").read_bytes()


def test_sha256_mismatch_keeps_nothing_and_says_what_to_do(offline, monkeypatch):
    release = offline / "release"
    sums = fake_release(release)
    monkeypatch.setattr(md, "SHA256", {**sums, "val.de.gz": "0" * 64})
    with pytest.raises(md.Multi30kError) as e:
        md.locate(base_url=release.as_uri(), opener=md.urllib.request.build_opener().open)
    msg = str(e.value)
    assert "val.de.gz has sha256 " in msg and "expected 0000000000000000..." in msg and "MULTI30K_DIR" in msg
    assert "\n" not in msg
    assert not (offline / "cache" / "val.de.gz").exists() and not list((offline / "cache").glob("*.part"))


def test_no_network_is_one_line_naming_both_ways_exit_1(offline, monkeypatch, capsys):
    def unreachable(url, timeout=None):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(md.urllib.request, "urlopen", unreachable)
    assert md.main([]) == 1
    lines = capsys.readouterr().err.splitlines()  # "[multi30k] downloading ...", then the error
    assert lines[-1].startswith("error: cannot download ") and sum("error" in line for line in lines) == 1
    assert f"{md.BASE_URL}/train.de.gz" in lines[-1] and "set MULTI30K_DIR (or --multi30k-dir)" in lines[-1]
    assert "Temporary failure in name resolution" in lines[-1] and not any("Traceback" in line for line in lines)
    # the matrix driver's prepare says the same, also as one line with exit 1
    assert mm.main(["prepare", "--work-dir", str(offline / "work")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: cannot download ") and not any("Traceback" in line for line in err)


def test_matrix_reads_multi30k_dir_option(tmp_path, monkeypatch):
    """``--multi30k-dir`` reaches the corpus lookup (which needs only the files to exist)."""
    seen = []

    def fake_locate(given=None, **_):
        seen.append(given)
        raise md.Multi30kError("stop here")

    monkeypatch.setattr(md, "locate", fake_locate)
    assert mm.main(["prepare", "--work-dir", str(tmp_path), "--multi30k-dir", str(tmp_path / "m30k")]) == 1
    assert [Path(s) for s in seen] == [tmp_path / "m30k"]


# ---- progress while translating -----------------------------------------------------------------


def gen_lines(n: int, nbest: int = 1) -> list:
    lines = [b"2026-11-23 10:00:00 | INFO | fairseq.tasks.translation | data-bin test de-en %d examples\n" % n]
    for i in range(n):
        lines.append(b"S-%d\tsrc \xc3\xa4 %d\n" % (i, i))  # bytes pass through untouched (UTF-8 here)
        lines += [b"H-%d\t-0.5\thyp %d\n" % (i, i)] * nbest
        lines.append(b"D-%d\t-0.5\thyp %d\r\n" % (i, i))
    return lines + [b"Generate test with beam=4: BLEU = 1.00\n"]


def test_relay_copies_bytes_and_reports_every_tenth():
    lines = gen_lines(25, nbest=2)
    out, reports = io.BytesIO(), []
    ticks = iter(range(100))
    n = gp.relay(lines, out, reports.append, clock=lambda: float(next(ticks)))
    assert n == 25 and out.getvalue() == b"".join(lines)
    counts = [int(re.search(r"\] (\d+)/25 ", r).group(1)) for r in reports]
    assert counts == [3, 6, 9, 12, 15, 18, 21, 24, 25]  # ceil(25 / 10) = 3, and the last one
    assert reports[-1].startswith("[translate] 25/25 sentences (100%), ") and "left" not in reports[-1]
    assert "about " in reports[0] and "s left" in reports[0]


def test_relay_without_a_total_and_with_an_explicit_interval():
    lines = [line for line in gen_lines(7) if b"examples" not in line]
    reports = []
    gp.relay(lines, io.BytesIO(), reports.append, every=2, label="dev")
    assert [r.split(" sentences")[0] for r in reports] == ["[dev] 2", "[dev] 4", "[dev] 6"]


def test_generate_through_the_filter_same_hypotheses_with_progress(synthetic_bin, tmp_path):
    """A real fairseq-generate, once straight into a file and once through the filter as the
    quickstart runs it: the same hypotheses, and progress lines with the test set's 100 sentences."""
    save = tmp_path / "ckpt"
    run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--arch", "deepinit_tiny", *TINY_DIMS,
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--max-update", "2",
        "--save-dir", save, "--no-progress-bar", "--disable-validation", "--no-epoch-checkpoints",
    )  # fmt: skip
    gen = [sys.executable, "-m", "fairseq_cli.generate", str(synthetic_bin), "--user-dir", USER_DIR]
    gen += ["--path", str(save / "checkpoint_last.pt"), "--gen-subset", "test", "--beam", "2", "--batch-size", "16"]
    gen += ["--required-batch-size-multiple", "1", "--cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    direct = subprocess.run(gen, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, check=True).stdout
    piped = tmp_path / "generate-test.txt"
    filt = [sys.executable, str(REPO / "scripts" / "generate_progress.py"), str(piped), "--total", "100"]
    cmd = f"{shlex.join(gen)} 2>/dev/null | {shlex.join(filt)}"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr

    def hypotheses(text: bytes) -> list:
        return [line for line in text.splitlines() if re.match(rb"[STHDP]-\d+\t", line)]

    assert hypotheses(piped.read_bytes()) == hypotheses(direct) and len(hypotheses(direct)) > 0
    progress = proc.stdout.splitlines()
    assert progress[-1].startswith("[translate] 100/100 sentences (100%)"), proc.stdout
    assert len(progress) >= 5  # batches of 16: a line every 10 sentences, as the batches arrive


def test_quickstart_translates_through_the_progress_filter():
    text = (REPO / "scripts" / "quickstart.sh").read_text()
    step = text[text.index('step translate "') : text.index('step score "')]
    assert '| "$PY" scripts/generate_progress.py "$GEN.tmp" --total "$(wc -l < "$BPE/test.de")"' in step
    assert "pipefail" in text


def train_log(counts) -> list:
    """fairseq-train's simple log: a progress line for each count, an end-of-epoch line for the last one."""
    lines = ["2026-01-01 00:00:00 | INFO | fairseq_cli.train | Start iterating over samples\n"]
    lines += [f"epoch 001:  {u:5d} / 118 loss=9.1, nll_loss=8.9, num_updates={u}, lr=0.001, wall=3\n" for u in counts]
    return lines + [f"epoch 001 | loss 9.05 | num_updates {counts[-1]} | wall 4\n"]


def test_train_progress_copies_lines_and_reports_tenths_with_the_time_left():
    """A resumed run (from 500) at 0.2 s per update: reports at each tenth of 1,500, the pace from this process's
    updates only; fairseq's lines unchanged; the last count, from the end-of-epoch line, reported once."""
    counts = list(range(525, 1501, 25))
    lines = train_log(counts)
    times = iter([0.0] + [0.2 * (u - 500) for u in counts])
    out = io.StringIO()
    assert tp.relay(lines, out, 1500, clock=lambda: next(times)) == 1500
    text = out.getvalue().splitlines(keepends=True)
    assert [line for line in text if not line.startswith("[train]")] == lines
    reports = [line.strip() for line in text if line.startswith("[train]")]
    assert [int(re.search(r"\] (\d+)/1500 ", r).group(1)) for r in reports] == [
        525,
        600,
        750,
        900,
        1050,
        1200,
        1350,
        1500,
    ]
    assert reports[0] == "[train] 525/1500 updates (35%), 5 s"  # no pace from one count
    assert reports[1] == "[train] 600/1500 updates (40%), 20 s, about 3 min 0 s left"  # 900 updates at 5/s
    assert reports[-1] == "[train] 1500/1500 updates (100%), 3 min 20 s"


def test_train_progress_reports_each_minute_between_tenths():
    lines = train_log([25, 50, 75])
    times = iter([0.0, 10.0, 80.0, 90.0])
    out = io.StringIO()
    tp.relay(lines, out, 100000, clock=lambda: next(times))
    reports = [line for line in out.getvalue().splitlines() if line.startswith("[train]")]
    assert [r.split(" updates")[0] for r in reports] == ["[train] 50/100000"]  # the first a minute after the start
    assert tp.duration(3725) == "1 h 2 min" and tp.duration(59.6) == "1 min 0 s"


def test_quickstart_trains_to_max_update_through_the_progress_filter():
    """No time limit by default; fairseq's log kept whole in train.log; a time limit that stops training is said
    beside the BLEU with the updates trained."""
    text = (REPO / "scripts" / "quickstart.sh").read_text()
    assert "TRAIN_MINUTES=${TRAIN_MINUTES:-0}" in text
    step = text[text.index('step train "') : text.index('step translate "')]
    assert '| tee -a "$RUN/train.log" | "$PY" scripts/train_progress.py --max-update "$MAX_UPDATE"' in step
    assert '[ "$TRAIN_MINUTES" = 0 ] || STOP=(--stop-time-hours' in step
    score = text[text.index('step score "') :]
    assert 'echo "trained: ${TRAINED:-?} of $MAX_UPDATE updates${TIME_CAPPED:+; $TIME_CAPPED}"' in score


# ---- --help of every command line ---------------------------------------------------------------


def console_parsers() -> dict:
    """``build_parser`` of every console script in setup.py: a new entry point without one fails here."""
    entries = re.findall(r'"([\w-]+) = ([\w.]+):main"', (REPO / "setup.py").read_text())
    assert entries, "no console_scripts found in setup.py"
    return {name: importlib.import_module(module).build_parser for name, module in entries}


PARSERS = {
    "multi30k_matrix.py": mm.build_parser,
    "multi30k_data.py": md.build_parser,
    "prepare_bible.py": prepare_bible.build_parser,
    "hf_tokenizer_check.py": htc.build_parser,
    "generate_progress.py": gp.build_parser,
    "train_progress.py": tp.build_parser,
    **console_parsers(),
}


def walk(parser: argparse.ArgumentParser, prog: str):
    """(program, parser, action) for every argument of ``parser`` and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                assert helps.get(name), f"{prog} {name}: subcommand without help"
                yield from walk(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prog, parser, action


def _mentions(text: str, default) -> bool:
    if str(default) in text:
        return True
    if isinstance(default, int | float) and not isinstance(default, bool):  # "1e-4" for 0.0001
        return any(float(m) == default for m in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", text))
    return False


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_option_says_what_it_does_and_its_default(name):
    problems = []
    for prog, parser, action in walk(PARSERS[name](), name):
        label = f"{prog} {'/'.join(action.option_strings) or action.dest}"
        if not action.help or action.help == argparse.SUPPRESS:
            problems.append(f"{label}: no help")
            continue
        text = parser._get_formatter()._expand_help(action)  # as --help prints it, %(default)s filled in
        if not action.option_strings or action.required or action.nargs == 0:
            continue  # positionals, required options and on/off flags have no default to state
        if action.default is None:
            if "default" not in text:
                problems.append(f"{label}: does not say what happens without it ('default: ...')")
        elif not _mentions(text, action.default):
            problems.append(f"{label}: help does not mention its default {action.default!r}: {text!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("script", ["quickstart.sh", "diagnose_multi30k.sh"])
def test_shell_scripts_print_their_knobs(script):
    proc = subprocess.run(["bash", str(REPO / "scripts" / script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "Knobs" in proc.stdout and "WORK_DIR" in proc.stdout
    bad = subprocess.run(["bash", str(REPO / "scripts" / script), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and bad.stderr.count("\n") == 1


# ---- the one builder of fairseq command lines -------------------------------------------------


def test_fairseq_argv_builder():
    """deepinit_tools.fairseq_argv: the plugin's bf16 (never fairseq's TPU --bf16), the command with the
    plugin next to the tools, its recorded form, and dimension flags fairseq parses to what was asked."""
    from fairseq import options

    from deepinit_tools import fairseq_argv as fa

    assert fa.precision_flags("bf16") == ["--task", "translation_deepinit", "--autocast-bf16"]
    assert fa.precision_flags("bf16", has_task=True) == ["--autocast-bf16"]
    assert (fa.precision_flags("fp16"), fa.precision_flags("amp"), fa.precision_flags("fp32")) == (
        ["--fp16"],
        ["--amp"],
        [],
    )
    with pytest.raises(ValueError, match="choose one of"):
        fa.precision_flags("bf32")
    cmd = fa.command("eval_lm", REPO / "data-bin", "--cpu")
    assert cmd[1:4] == ["-m", "fairseq_cli.eval_lm", str(REPO / "data-bin")] and cmd[4:] == [
        "--user-dir",
        USER_DIR,
        "--cpu",
    ]
    assert fa.printable(cmd) == "fairseq-eval-lm data-bin --user-dir fairseq_deepinit --cpu"
    argv = ["/nonexistent", "--task", "translation", "-s", "de", "-t", "en", "--arch", "transformer"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv + fa.dims(3, 48, 96, 2))
    got = [
        getattr(args, f"{s}_{k}")
        for s in ("encoder", "decoder")
        for k in ("layers", "embed_dim", "ffn_embed_dim", "attention_heads")
    ]
    assert got == [3, 48, 96, 2] * 2
    lm = fa.dims(5, 32, 64, 4, ("decoder",))
    assert lm == [
        "--decoder-layers",
        "5",
        "--decoder-embed-dim",
        "32",
        "--decoder-ffn-embed-dim",
        "64",
        "--decoder-attention-heads",
        "4",
    ]
