"""``deepinit-export`` as a command: what it writes, what it refuses in one line, and that its stock checkpoint
loads in a fairseq process that never imported the plugin (and from fairseq-hydra-train checkpoints)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from export_cases import build_case, resolved, write_checkpoint

from fairseq_deepinit.export import cli, scoring, source, to_fairseq

pytest.importorskip("ctranslate2")

PRELN = ("preln", (), False)
TWT = ("twt", (), False)
ADMIN_LM = ("admin_closed", (), True)


def export(capsys, *argv) -> tuple:
    """``(exit status, stderr lines)`` of ``deepinit-export argv``."""
    code = cli.main([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture
def twt_checkpoint(tmp_path):
    model, args = build_case(TWT)
    return (*write_checkpoint(model, args, tmp_path), model, args)


def test_ctranslate2_folder_holds_the_model_its_vocabularies_and_what_it_came_from(twt_checkpoint, tmp_path, capsys):
    ckpt, data, model, args = twt_checkpoint
    out = tmp_path / "ct2"
    assert export(capsys, ckpt, out, "--to", "ctranslate2") == (0, [])  # the dictionaries from the stored task.data
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "deepinit_export.json",
        "model.bin",
        "shared_vocabulary.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["add_source_eos"] is True and config["decoder_start_token"] == "</s>"
    assert config["layer_norm_epsilon"] == pytest.approx(args.norm_eps**2 / 32)  # ScaleNorm's eps^2/d
    vocab = json.loads((out / "shared_vocabulary.json").read_text())
    assert vocab[:4] == ["<s>", "<blank>", "</s>", "<unk>"] and len(vocab) == len(model.decoder.dictionary)
    meta = json.loads((out / "deepinit_export.json").read_text())
    assert meta["source"] == str(ckpt.resolve()) and meta["quantization"] == "float32"
    # a second export replaces the folder only with --force (atomically: no temporary left beside it)
    code, err = export(capsys, ckpt, out, "--to", "ctranslate2", "--data", data, "--no-check")
    assert code == 1 and err == [
        f"deepinit-export: error: the output {out} exists (a CTranslate2 model); give --force to replace it"
    ]
    assert export(capsys, ckpt, out, "--to", "ctranslate2", "--data", data, "--no-check", "--force")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_int8_is_checked_in_float32_first_and_reported(twt_checkpoint, tmp_path, capsys, caplog):
    ckpt, data, model, args = twt_checkpoint
    with caplog.at_level("INFO"):
        assert export(capsys, ckpt, tmp_path / "int8", "--to", "ctranslate2", "--quantization", "int8")[0] == 0
    line = [r.getMessage() for r in caplog.records if "wrote" in r.getMessage()][0]
    assert "CTranslate2 model (int8)" in line and "(float32)" in line and "(int8)" in line
    m64 = source.build_plugin_model(model.state_dict(), args, torch.float64)
    int8 = scoring.load_ct2(str(tmp_path / "int8"), lm=False, compute_type="int8")
    vocab = json.loads((tmp_path / "int8" / "shared_vocabulary.json").read_text())
    sentences = scoring.random_sentences(m64)
    diff = scoring.max_difference(
        scoring.plugin_scores(m64, sentences), scoring.ct2_scores(int8, [vocab] * 2, sentences)
    )
    assert 1e-4 < diff < 1.0  # quantized: not the model to round-off, but close


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--to", "fairseq"), "cannot export to fairseq: --norm-type scalenorm: a stock fairseq transformer has"),
        (("--to", "fairseq", "--quantization", "int8"), "--quantization applies to --to ctranslate2 only"),
        (("--to", "ctranslate2", "--data", "/nonexistent"), "the dictionaries are needed for the exported"),
    ],
)
def test_bad_requests_are_one_line_and_write_nothing(twt_checkpoint, tmp_path, capsys, argv, message):
    ckpt = twt_checkpoint[0]
    code, err = export(capsys, ckpt, tmp_path / "out", *argv)
    assert code == 1 and len(err) == 1 and err[0].startswith("deepinit-export: error: ") and message in err[0]
    assert not (tmp_path / "out").exists()


def test_outputs_that_must_not_be_written(twt_checkpoint, tmp_path, capsys):
    ckpt, data = twt_checkpoint[:2]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    cases = [
        (ckpt, "fairseq", "is the input checkpoint; the export would replace it"),
        (data, "fairseq", "is a folder; give the exported checkpoint's file name"),
        (tmp_path / "busy", "ctranslate2", "is not empty and holds no CTranslate2 model"),
        (ckpt, "ctranslate2", "is the input checkpoint"),
    ]
    for out, to, message in cases:
        code, err = export(capsys, ckpt, out, "--to", to)
        assert code == 1 and len(err) == 1 and message in err[0], err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    code, err = export(capsys, tmp_path / "missing.pt", tmp_path / "x.pt", "--to", "fairseq")
    assert code == 1 and len(err) == 1 and "missing.pt" in err[0]


def test_a_dictionary_of_another_size_is_refused(twt_checkpoint, tmp_path, capsys):
    ckpt, data = twt_checkpoint[:2]
    lines = (data / "dict.tgt.txt").read_text().splitlines()
    (data / "dict.tgt.txt").write_text("\n".join(lines[:-3]) + "\n")
    code, err = export(capsys, ckpt, tmp_path / "ct2", "--to", "ctranslate2")
    assert code == 1 and len(err) == 1 and "symbols and the model's decoder embedding" in err[0]


def test_a_stock_fairseq_checkpoint_is_not_exported(tmp_path, capsys):
    model, args = build_case(PRELN)
    ckpt, _data = write_checkpoint(model, args, tmp_path)
    state = torch.load(ckpt, weights_only=False)
    state["cfg"]["model"].arch = "transformer_iwslt_de_en"
    torch.save(state, ckpt)
    code, err = export(capsys, ckpt, tmp_path / "x.pt", "--to", "fairseq")
    assert code == 1 and "not of a deepinit model: a stock fairseq checkpoint needs no export" in err[0]


def test_a_hydra_style_model_node_exports_as_the_namespace_does(tmp_path, capsys):
    """fairseq-hydra-train stores the model's options as a dict named by ``_name`` (model_config.keep_resolved)."""
    model, args = build_case(PRELN)
    ckpt, _data = write_checkpoint(model, args, tmp_path)
    state = torch.load(ckpt, weights_only=False)
    state["cfg"]["model"] = {**to_fairseq._primitive(vars(args)), "_name": "preln_iwslt_de_en"}
    torch.save(state, ckpt)
    assert export(capsys, ckpt, tmp_path / "a.pt", "--to", "fairseq")[0] == 0
    assert export(capsys, ckpt, tmp_path / "a-ct2", "--to", "ctranslate2")[0] == 0


STOCK_CHILD = r"""
import json, sys, torch
from fairseq import checkpoint_utils
models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([sys.argv[1]], arg_overrides={"data": sys.argv[2]})
model = models[0].eval()
batch = torch.load(sys.argv[3])
with torch.no_grad():
    if batch["src"] is None:
        logits = model(batch["prev"])[0]
    else:
        logits = model(batch["src"], batch["lengths"], batch["prev"])[0]
lp = torch.log_softmax(logits.double(), -1)
loaded = sorted(m for m in sys.modules if "deepinit" in m)
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "plugin_modules": loaded}))
torch.save(lp, sys.argv[4])
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", [("admin", (), False), ADMIN_LM, ("completep", (), False)], ids=str)
def test_stock_export_loads_in_a_fairseq_process_that_never_imported_the_plugin(case, tmp_path, capsys):
    model, args = build_case(case)
    ckpt, data = write_checkpoint(model, args, tmp_path)
    assert export(capsys, ckpt, tmp_path / "stock.pt", "--to", "fairseq")[0] == 0
    m64 = source.build_plugin_model(model.state_dict(), args, torch.float64)
    batch = to_fairseq._random_batch(m64)
    torch.save({"src": batch[0], "lengths": batch[1], "prev": batch[2]}, tmp_path / "batch.pt")
    child = subprocess.run(
        [sys.executable, "-c", STOCK_CHILD, tmp_path / "stock.pt", data, tmp_path / "batch.pt", tmp_path / "lp.pt"],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: nothing of the plugin on the path but what is installed, never imported
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["plugin_modules"] == []
    assert report["class"] in ("fairseq.models.transformer.transformer_legacy.TransformerModel",
                               "fairseq.models.transformer_lm.TransformerLanguageModel")  # fmt: skip
    got = torch.load(tmp_path / "lp.pt")
    want = to_fairseq.log_probs(m64, batch)
    assert (got - want).abs()[batch[3]].max().item() < 1e-5


@pytest.mark.slow
def test_fairseq_hydra_train_checkpoints_export_to_both_targets(synthetic_bin, tmp_path, capsys):
    from test_hydra import TINY, hydra_train

    lang = ["task.source_lang=src", "task.target_lang=tgt", "dataset.max_tokens=1000"]
    runs = {"tfixup_iwslt14_de_en": "ctranslate2", "deepnorm_wmt17_en_de": "fairseq"}
    for config, to in runs.items():
        save = tmp_path / config
        hydra_train(config, synthetic_bin, save, *TINY, *lang, log=tmp_path / f"{config}.log")
        out = tmp_path / f"{config}.{'pt' if to == 'fairseq' else 'ct2'}"
        data = ["--data", synthetic_bin] if to == "ctranslate2" else []
        code, err = export(capsys, save / "checkpoint_last.pt", out, "--to", to, *data)
        assert code == 0, err
        assert out.exists()


@pytest.mark.slow
def test_the_family_table_in_the_docs_is_the_generated_one():
    from fairseq_deepinit.export import table

    assert table.current(table.DOC.read_text()) == table.render(), (
        "docs/export.md's table is stale: python -m fairseq_deepinit.export.table --write"
    )


def test_an_option_the_route_was_not_written_for_is_refused(monkeypatch):
    """A method added after the export (its option set, its residual or norm unknown) is refused, not ignored."""
    from fairseq_deepinit.export import route

    args = resolved(("lnscale", (), False))
    assert route.classify(args).fairseq == "fold"
    monkeypatch.setattr(route, "UNDERSTOOD", route.UNDERSTOOD - {"layernorm_scaling"})
    reasons = route.classify(args).reasons
    want = "--layernorm-scaling (LayerNorm Scaling): the export does not carry this option yet"
    assert reasons == {target: want for target in route.TARGETS}
    monkeypatch.setattr(route, "KNOWN_RESIDUALS", ("none",))
    assert "no fold for this residual" in route.classify(resolved(("admin", (), False))).reasons[route.FAIRSEQ]
