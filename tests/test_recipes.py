"""The paper recipes in ``examples/``: every row's fairseq commands parse with the plugin loaded (one
process for all rows, no training), the data pipeline on local files, one row end to end on a tiny
local corpus (``DATA_DIR`` override: preparation, training, averaging, generation, scoring), and the
helpers of ``examples/recipe_tools.py`` by hand. Nothing is downloaded."""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, USER_DIR, write_synthetic_corpus

EXAMPLES = REPO / "examples"
RECIPES = sorted(p for p in EXAMPLES.glob("*/*.sh") if not p.name.startswith("_"))
_spec = importlib.util.spec_from_file_location("recipe_tools", EXAMPLES / "recipe_tools.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)

OVERRIDES = {
    "DATA_DIR", "TOKENIZE", "MOSES_DIR", "WORK_DIR", "MAX_UPDATE", "EXTRA_ARGS", "GEN_EXTRA_ARGS", "GPUS",
    "BPE_TOKENS", "AVG_N", "SEED", "PYTHON",
}  # fmt: skip
TINY = (
    "--encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 "
    "--encoder-attention-heads 2 --decoder-attention-heads 2 --encoder-layers 2 --decoder-layers 2"
)


def recipe(script: Path, *args: str, env: dict, timeout: int = 60, check: bool = True) -> subprocess.CompletedProcess:
    # the recipes' own overrides come only from the test, never from the caller's environment
    full = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    full.update({"OMP_NUM_THREADS": "1", "THREADS": "1", **env})
    proc = subprocess.run(["bash", str(script), *args], env=full, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def list_rows(script: Path, env: dict) -> list[str]:
    lines = recipe(script, "--list", env=env).stdout.splitlines()
    return [line.split()[0] for line in lines[1:]]


def commands(out: str, tool: str) -> list[list[str]]:
    """The ``tool`` command lines of a ``--dry-run`` output, without their ``> FILE`` redirection."""
    found = []
    for argv in map(shlex.split, out.splitlines()):
        if argv and Path(argv[0]).name == tool:
            found.append(argv[: argv.index(">")] if ">" in argv else argv)
    return found


def test_recipes_exist_for_every_paper():
    papers = {p.parent.name for p in RECIPES}
    assert papers == {"admin", "deepnorm", "dsinit", "lipschitz", "tfixup", "twt"}


def test_every_row_of_every_recipe_parses_with_the_plugin(tmp_path):
    """``--dry-run`` of every recipe; each fairseq-train/-generate/-preprocess command is parsed by
    fairseq with the plugin loaded, and every model's options pass the plugin's own validation."""
    from fairseq import options

    import fairseq_deepinit  # noqa: F401
    from fairseq_deepinit.options import resolve_and_validate

    env = {"GPUS": "cpu", "WORK_DIR": str(tmp_path / "work")}
    n_rows = 0
    for script in RECIPES:
        rows = list_rows(script, env)
        assert rows and len(set(rows)) == len(rows), f"{script}: rows missing or duplicated"
        out = recipe(script, "--dry-run", env=env).stdout
        trains, gens = commands(out, "fairseq-train"), commands(out, "fairseq-generate")
        assert len(trains) == len(gens) == len(rows), f"{script}: one train and one generate command per row"
        for argv in commands(out, "fairseq-preprocess"):
            options.get_preprocessing_parser().parse_args(argv[1:])
        for row, argv in zip(rows, trains, strict=True):
            where = f"{script.relative_to(REPO)} {row}"
            assert argv[argv.index("--user-dir") + 1] == USER_DIR, where
            assert "--bf16" not in argv, where
            assert "--cpu" in argv and "--fp16" not in argv, where  # GPUS=cpu
            args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
            assert args.arch.split("_")[0] in {
                "postln", "preln", "lipschitz", "tfixup", "dsinit", "matt", "twt", "deepnorm", "rezero", "admin",
            }, where  # fmt: skip
            resolve_and_validate(copy.deepcopy(args))  # the model's own start-up validation
            assert f"/{script.parent.name}/{script.stem}/{row}-" in args.save_dir, where
            n_rows += 1
        for argv in gens:
            args = options.parse_args_and_arch(options.get_generation_parser(), argv[1:])
            assert (
                args.gen_subset == "test"
                and args.post_process == "subword_nmt"
                and args.required_batch_size_multiple == 1
            )
    assert n_rows >= 50


def test_rows_reproduce_the_papers_settings(tmp_path):
    """Spot checks of the flags that carry each paper's claim."""
    env = {"GPUS": "cpu", "WORK_DIR": str(tmp_path)}

    def train_argv(script: str, row: str) -> list[str]:
        (argv,) = commands(recipe(EXAMPLES / script, row, "--dry-run", env=env).stdout, "fairseq-train")
        return argv

    def value(argv: list[str], flag: str) -> str:
        return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last occurrence wins in argparse

    admin = train_argv("admin/table2_iwslt14_de_en.sh", "admin")
    assert value(admin, "--task") == "translation_admin" and value(admin, "--optimizer") == "radam"
    assert value(admin, "--lr") == "7e-4" and value(admin, "--warmup-updates") == "6000"
    tfixup = train_argv("tfixup/iwslt14_de_en.sh", "tfixup")
    assert value(tfixup, "--lr-scheduler") == "tfixup" and value(tfixup, "--dropout") == "0.5"
    assert "--warmup-updates" not in tfixup
    twt = train_argv("twt/iwslt15_en_vi.sh", "prenorm-fixnorm-scalenorm")
    assert value(twt, "--lr-scheduler") == "reduce_lr_on_plateau"
    # fairseq-train stops before an epoch with lr <= --stop-min-lr (train.py:196): the warm-up starts above it
    assert float(value(twt, "--warmup-init-lr")) > float(value(twt, "--stop-min-lr"))
    assert (value(twt, "--lr-shrink"), value(twt, "--lr-patience")) == ("0.8", "3")
    assert value(twt, "--best-checkpoint-metric") == "bleu" and "--maximize-best-checkpoint-metric" in twt
    fr = train_argv("admin/table2_wmt14_en_fr.sh", "admin-60-12l")
    assert (value(fr, "--encoder-layers"), value(fr, "--decoder-layers")) == ("60", "12")
    lip = train_argv("lipschitz/table3_wmt14_en_de.sh", "v1L-enc24")
    assert value(lip, "--arch") == "lipschitz_wmt_en_de" and value(lip, "--encoder-layers") == "24"
    listed = recipe(EXAMPLES / "lipschitz/table3_wmt14_en_de.sh", "--list", env=env).stdout
    assert re.search(r"^v1L-enc18\s+29\.05\s", listed, re.M)


@pytest.mark.parametrize(
    ("gpus", "update_freq", "fp16"), [("cpu", "256", False), ("0,1,2,3", "64", True), ("0,1,2", "86", True)]
)
def test_update_freq_keeps_the_papers_batch(tmp_path, gpus, update_freq, fp16):
    """Admin's En-Fr 60-12L batch is 16 GPUs x update-freq 16; the recipe spreads it over GPUS."""
    proc = recipe(
        EXAMPLES / "admin/table2_wmt14_en_fr.sh",
        "admin-60-12l",
        "--dry-run",
        env={"GPUS": gpus, "WORK_DIR": str(tmp_path)},
    )
    (argv,) = commands(proc.stdout, "fairseq-train")
    assert argv[argv.index("--update-freq") + 1] == update_freq
    assert ("--fp16" in argv) is fp16 and ("--cpu" in argv) is (gpus == "cpu")
    assert ("258/256" in proc.stderr) is (gpus == "0,1,2")  # 3 x 86 = 258 updates' worth: said, not hidden


def test_bad_input_says_what_to_do(tmp_path):
    env = {"GPUS": "cpu", "WORK_DIR": str(tmp_path)}
    script = EXAMPLES / "admin/table2_iwslt14_de_en.sh"
    proc = recipe(script, "no-such-row", "--dry-run", env=env, check=False)
    assert proc.returncode != 0 and "unknown row 'no-such-row'" in proc.stderr and "admin" in proc.stderr
    proc = recipe(script, env=env, check=False)
    assert proc.returncode != 0 and "--list" in proc.stderr
    (tmp_path / "only_train").mkdir()
    (tmp_path / "only_train" / "train.de").write_text("a\n")
    (tmp_path / "only_train" / "train.en").write_text("b\n")
    proc = recipe(
        script, "--prepare-only", env={**env, "DATA_DIR": str(tmp_path / "only_train"), "TOKENIZE": "none"}, check=False
    )
    assert proc.returncode != 0 and "has no test.de" in proc.stderr


SRC_WORDS = "ab cd ef gh ij kl mn".split()
TGT_WORDS = "op qr st uv wx yz ba".split()


def test_local_data_pipeline_splits_validation_and_cleans_after_bpe(tmp_path):
    """WMT14 En-De preparation on local tokenized files without a validation set: every 100th
    training line becomes validation (before BPE, as prepare-wmt14en2de.sh), then train and valid are
    cleaned (1-250 tokens, ratio 1.5) after BPE; the test set is never cleaned."""
    raw = tmp_path / "raw"
    raw.mkdir()
    src, tgt = [], []
    for i in range(1, 501):
        n = 3 + i % 5
        src.append(" ".join(SRC_WORDS[(i + k) % 7] for k in range(n)))
        tgt.append(" ".join(TGT_WORDS[(i * k) % 7] for k in range(2 * n if i % 50 == 0 else n)))  # ratio 2 every 50th
    (raw / "train.en").write_text("\n".join(src) + "\n")
    (raw / "train.de").write_text("\n".join(tgt) + "\n")
    (raw / "test.en").write_text("ab cd\nab cd ef gh ij kl\n")
    (raw / "test.de").write_text("op qr st uv wx\nyz\n")  # ratios 2.5 and 6: kept, the test set is not cleaned
    # two-letter words: 50 merges join every word's two symbols, so BPE changes nothing
    env = {
        "GPUS": "cpu",
        "WORK_DIR": str(tmp_path / "work"),
        "DATA_DIR": str(raw),
        "TOKENIZE": "none",
        "BPE_TOKENS": "50",
    }
    proc = recipe(EXAMPLES / "lipschitz/table3_wmt14_en_de.sh", "--prepare-only", env=env, timeout=120)
    (bin_dir,) = (tmp_path / "work" / "data").glob("wmt14_en_de-local-*/tok-none/bpe50/bin-joined")
    assert proc.stdout.strip().endswith(str(bin_dir))
    bpe = bin_dir.parent
    valid_idx = [i for i in range(1, 501) if i % 100 == 0]  # 100, 200, ... 500: all have ratio 2 -> cleaned away
    train_idx = [i for i in range(1, 501) if i % 100 != 0 and i % 50 != 0]
    assert "@@" not in (bpe / "train.en").read_text() + (bpe / "train.de").read_text()
    assert (bpe / "train.en").read_text().splitlines() == [src[i - 1] for i in train_idx]
    assert (bpe / "train.de").read_text().splitlines() == [tgt[i - 1] for i in train_idx]
    # validation = every 100th line split off *before* cleaning; all of those are unbalanced (ratio 2)
    assert (bpe / "valid.en").read_text() == ""
    assert (bpe / "test.de").read_text().splitlines() == ["op qr st uv wx", "yz"]
    assert (bin_dir / "train.en-de.en.bin").exists() and (bin_dir / "dict.en.txt").read_text() == (
        bin_dir / "dict.de.txt"
    ).read_text()  # --joined-dictionary
    assert len(valid_idx) == 5
    # a second run finds everything prepared and does nothing
    again = recipe(EXAMPLES / "lipschitz/table3_wmt14_en_de.sh", "--prepare-only", env=env)
    assert "already binarized" in again.stderr


def test_override_path_runs_one_row_end_to_end(tmp_path):
    """Admin's IWSLT row on a tiny local corpus: preparation, Admin profiling and training (RAdam),
    averaging of the last 2 epoch checkpoints, generation and tokenized BLEU."""
    import torch

    data = write_synthetic_corpus(tmp_path / "raw", n_train=1000, n_valid=50, n_test=30)
    work = tmp_path / "work"
    env = {
        "DATA_DIR": str(data),  # {train,valid,test}.{src,tgt}
        "WORK_DIR": str(work),
        "TOKENIZE": "none",
        "GPUS": "cpu",
        "BPE_TOKENS": "30",
        "MAX_UPDATE": "40",
        "AVG_N": "2",
        "EXTRA_ARGS": f"{TINY} --max-tokens 1000 --num-workers 0 --max-epoch 2",
        "GEN_EXTRA_ARGS": "--beam 2 --max-len-a 1 --max-len-b 5",
    }
    proc = recipe(EXAMPLES / "admin/table2_iwslt14_de_en.sh", "admin", env=env, timeout=600)
    out = proc.stdout + proc.stderr
    (run,) = (work / "runs" / "admin" / "table2_iwslt14_de_en").glob("admin-*")
    train_cmd = (run / "train.cmd").read_text()
    assert "--task translation_admin" in train_cmd and "--max-update 40" in train_cmd
    assert train_cmd.rstrip().endswith(f"--max-epoch 2 --save-dir {run}")  # EXTRA_ARGS last: they win
    log = (run / "train.log").read_text()
    assert "admin: " in log  # Admin profiled omega on the first batch
    updates = [int(n) for n in re.findall(r"num_updates (\d+)", log)]
    assert 0 < max(updates) <= 40 and "done training" in log
    # the validation set is DATA_DIR's, not split off the training data
    (bpe,) = (work / "data").glob("iwslt14_de_en-local-*/tok-none/bpe30")
    assert len((bpe / "valid.de").read_text().splitlines()) == 50
    assert len((bpe / "train.de").read_text().splitlines()) == 1000  # synthetic pairs all pass clean 1-175 / 1.5

    load = lambda p: torch.load(p, map_location="cpu", weights_only=False)["model"]  # noqa: E731
    c1, c2, avg = load(run / "checkpoint1.pt"), load(run / "checkpoint2.pt"), load(run / "checkpoint_avg2.pt")
    assert avg.keys() == c1.keys()
    for k in ("encoder.layers.0.fc1.weight", "decoder.embed_tokens.weight"):
        assert torch.allclose(avg[k], (c1[k] + c2[k]) / 2, atol=1e-7)
    omega = [k for k in c1 if "omega" in k]
    assert omega and all(torch.allclose(avg[k], (c1[k] + c2[k]) / 2, atol=1e-7) for k in omega)

    gen = (run / "generate-test.txt").read_text()
    assert len(re.findall(r"^H-\d+\t", gen, re.M)) == 30  # every test sentence translated
    fairseq_bleu = float(re.search(r"BLEU4 = ([\d.]+)", gen).group(1))
    line = (run / "bleu.txt").read_text()
    assert re.match(r"BLEU = [\d.]+ \(tokenized", line)
    assert float(line.split()[2]) == pytest.approx(fairseq_bleu, abs=0.01)  # same number as fairseq-generate's
    assert "paper: 35.67" in out


# ---------------------------------------------------------------------------------------------
# recipe_tools by hand


def test_clean_pair_matches_clean_corpus_n():
    assert rt.clean_pair("a  b |c\n", " x y z ", 1, 175, 1.5) == ("a b c", "x y z")  # '|' dropped, spaces collapsed
    assert rt.clean_pair("a b", "x y z", 1, 175, 1.5) == ("a b", "x y z")  # 3/2 = 1.5 is not > 1.5
    assert rt.clean_pair("a", "x y", 1, 175, 1.5) is None  # 2/1 > 1.5
    assert rt.clean_pair("", "x", 1, 175, 9) is None
    assert rt.clean_pair(" ".join("a" * 6), "x " * 6, 1, 5, 9) is None  # 6 words > max 5
    assert rt.clean_pair("a b c d e", "x y z v w", 1, 5, 9) == ("a b c d e", "x y z v w")


def test_clean_files_refuses_a_non_parallel_corpus(tmp_path):
    (tmp_path / "a").write_text("x\ny\n")
    (tmp_path / "b").write_text("x\n")
    with pytest.raises(rt.RecipeError, match="not parallel"):
        rt.clean_files(tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d", 1, 10, 9)


def write_gen(path: Path, hyps: list[str], refs: list[str], order: list[int]) -> Path:
    lines = []
    for i in order:
        lines += [f"S-{i}\tsrc", f"T-{i}\t{refs[i]}", f"H-{i}\t-0.3\t{hyps[i]}", f"D-{i}\t-0.3\t{hyps[i]}"]
    path.write_text("\n".join(lines + ["Generate test with beam=5: BLEU4 = 0.00"]) + "\n")
    return path


def test_tokenized_bleu_by_hand(tmp_path):
    refs = ["the cat sat on the mat .", "a well-known dog ran away quickly ."]
    hyps = ["the cat sat on the mat .", "a well-known dog ran off quickly ."]
    gen = write_gen(tmp_path / "gen.txt", hyps, refs, order=[1, 0])  # fairseq's length order
    # 14 unigrams / 12 bigrams / 10 trigrams / 8 4-grams; "off" (5th of 7 tokens) is in 1 / 2 / 3 / 3 of them
    expected = 100 * math.exp(sum(math.log(p) for p in (13 / 14, 10 / 12, 7 / 10, 5 / 8)) / 4)
    assert rt.score(gen, "tok").startswith(f"BLEU = {expected:.2f} (tokenized")
    # compound splitting: "well-known" -> "well ##AT##-##AT## known" adds 2 matching tokens on both sides;
    # "off" is then the 7th of 9 tokens: 16 / 14 / 12 / 10 n-grams, 1 / 2 / 3 / 3 of them wrong
    assert rt.compound_split("a well-known x-ray - b") == "a well ##AT##-##AT## known x ##AT##-##AT## ray - b"
    expected = 100 * math.exp(sum(math.log(p) for p in (15 / 16, 12 / 14, 9 / 12, 7 / 10)) / 4)
    assert rt.score(gen, "compound").startswith(f"BLEU = {expected:.2f} (tokenized, compound-split")
    # no smoothing, like multi-bleu.perl and fairseq: one missing 4-gram order gives 0
    gen0 = write_gen(tmp_path / "gen0.txt", ["a b c"], ["a b c d"], order=[0])
    assert rt.score(gen0, "tok").startswith("BLEU = 0.00")


def test_sacrebleu_detokenizes_and_scores_against_raw_references(tmp_path):
    refs_raw = ["The cat sat on the mat.", "Hello, world!"]
    gen = write_gen(tmp_path / "gen.txt", ["The cat sat on the mat .", "Hello , world !"], ["x", "y"], order=[1, 0])
    (tmp_path / "ref.txt").write_text("\n".join(refs_raw) + "\n")
    # a stand-in detokenizer (Moses' is not available offline): joins punctuation to the previous word
    detok = tmp_path / "detok.py"
    detok.write_text("import re, sys\nfor l in sys.stdin: sys.stdout.write(re.sub(r' ([.,!])', r'\\1', l))\n")
    import sys

    line = rt.score(gen, "sacrebleu", tmp_path / "ref.txt", f"{sys.executable} {detok}")
    assert line.startswith("BLEU = 100.00 (sacreBLEU") and "tok:13a" in line
    with pytest.raises(rt.RecipeError, match="needs --ref"):
        rt.score(gen, "sacrebleu")


def test_read_generate_refuses_missing_sentences(tmp_path):
    gen = write_gen(tmp_path / "gen.txt", ["a", "b", "c"], ["a", "b", "c"], order=[0, 2])
    with pytest.raises(rt.RecipeError, match="missing ids \\[1\\].*required-batch-size-multiple 1"):
        rt.read_generate(gen)


def test_last_checkpoints_order_bound_and_shortage(tmp_path):
    for name in ["checkpoint1.pt", "checkpoint2.pt", "checkpoint10.pt", "checkpoint_best.pt", "checkpoint_3_1500.pt"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in rt.last_checkpoints(tmp_path, "epoch", 2)] == ["checkpoint10.pt", "checkpoint2.pt"]
    assert [p.name for p in rt.last_checkpoints(tmp_path, "epoch", 2, upper_bound=9)] == [
        "checkpoint2.pt",
        "checkpoint1.pt",
    ]
    assert [p.name for p in rt.last_checkpoints(tmp_path, "update", 1)] == ["checkpoint_3_1500.pt"]
    with pytest.raises(rt.RecipeError, match="found 3 epoch checkpoint.*need 4.*AVG_N=3"):
        rt.last_checkpoints(tmp_path, "epoch", 4)


def test_average_states_by_hand():
    import torch

    states = [
        {
            "model": {
                "w": torch.tensor([1.0, 2.0]),
                "h": torch.tensor([1.0], dtype=torch.float16),
                "n": torch.tensor(3),
            },
            "extra": i,
        }
        for i in range(3)
    ]
    states[1]["model"]["w"] = torch.tensor([4.0, -2.0])
    states[2]["model"]["w"] = torch.tensor([1.0, 3.0])
    states[2]["model"]["h"] = torch.tensor([2.0], dtype=torch.float16)
    out = rt.average_states(states)
    assert torch.equal(out["model"]["w"], torch.tensor([2.0, 1.0]))
    assert out["model"]["h"].dtype == torch.float16 and out["model"]["h"].item() == pytest.approx(4 / 3, abs=1e-3)
    assert out["model"]["n"].item() == 3 and out["extra"] == 0  # the newest (first) checkpoint's other entries
    states[1]["model"]["n"] = torch.tensor(4)
    with pytest.raises(rt.RecipeError, match="'n' differs"):
        rt.average_states(states)


def test_recipe_tools_bad_input_is_one_line_and_status_1(tmp_path):
    """A bad --num and a missing file: one line on stderr, exit status 1, no traceback."""
    tool = str(EXAMPLES / "recipe_tools.py")
    average = ["average", "--inputs", str(tmp_path), "--mode", "epoch", "--num", "0", "--output", str(tmp_path / "a")]
    score = ["score", str(tmp_path / "missing.gen"), "--mode", "tok"]
    runs = {"--num must be at least 1": average, "missing.gen": score}
    for expected, argv in runs.items():
        proc = subprocess.run([sys.executable, tool, *argv], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("recipe_tools.py: error: ") and expected in lines[0], lines
