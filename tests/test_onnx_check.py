"""benchmarks/onnx_check.py: ONNX export of transformers model folders, onnxruntime's logits against PyTorch's.

The onnx packages are not in the pinned stack: without them the script says how to install them (one line,
exit 1), checked here by hiding one. What it exports is checked without them: :class:`TeacherForced` (the
traced forward) gives the model's own teacher-forced logits bit for bit, FSMT's decoder padding mask included.
The export itself runs where onnx, onnxscript and onnxruntime are installed (skipped otherwise).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from deepinit_tools.bench import onnx_check as oc


def _one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        oc.main(argv)
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err
    return err


def test_missing_onnx_package_is_one_line_saying_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    err = _one_line_error(capsys, [])
    assert "onnxruntime" in err and "requirements/onnx.txt" in err


@pytest.mark.parametrize(
    "config, says",
    [(None, "no config.json"), ("[1]", "not a JSON object"), ('{"model_type": "bert"}', "model_type 'bert'")],
)
def test_a_folder_that_is_not_one_of_the_three_classes_is_refused_in_one_line(capsys, tmp_path, config, says):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    assert says in _one_line_error(capsys, ["--model", str(tmp_path)])


def test_two_model_folders_of_the_same_name_are_refused(capsys, tmp_path):
    for parent in ("a", "b"):
        (tmp_path / parent / "m").mkdir(parents=True)
        (tmp_path / parent / "m" / "config.json").write_text('{"model_type": "xglm"}')
    assert "same name" in _one_line_error(
        capsys, ["--model", str(tmp_path / "a" / "m"), "--model", str(tmp_path / "b" / "m")]
    )


def test_a_tolerance_that_is_not_a_finite_number_is_refused(capsys):
    assert "--tolerance" in _one_line_error(capsys, ["--tolerance", "nan"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    return {f.name: oc.load(f) for f in oc.random_models(tmp_path_factory.mktemp("hf"), seed=1)}


@pytest.mark.parametrize("kind", sorted(oc.CLASSES))
def test_the_traced_forward_is_the_models_own_teacher_forced_forward(tiny, kind):
    """Padded batches (decoder pads included): the logits of :class:`TeacherForced` are those of
    ``model(**inputs, use_cache=False)``, bit for bit, at every position (FSMT: the decoder padding mask the
    wrapper passes is the one the model builds from the pads itself)."""
    model = tiny[kind]
    assert type(model).__name__ == oc.CLASSES[kind]
    assert not model.training and not oc.TeacherForced(model).training  # an exporter restoring it keeps eval
    for size, source, target, seed in ((2, 7, 5, 1), (3, 11, 6, 2), (1, 4, 3, 3)):
        inputs = oc.batch(model.config, size, source, target, seed)
        with torch.no_grad():
            got = oc.TeacherForced(model)(*inputs.values())
        torch.testing.assert_close(got, oc.reference_logits(model, inputs), rtol=0, atol=0)


def test_fsmt_reference_is_causal_only_without_the_cache(tiny):
    """FSMT applies its causal mask in the teacher-forced forward only with ``use_cache=False`` (the config's
    default is True): changing the last decoder token changes the earlier positions' logits otherwise."""
    model = tiny["fsmt"]
    inputs = oc.batch(model.config, 1, 6, 5, 4)
    changed = {**inputs, "decoder_input_ids": inputs["decoder_input_ids"].clone()}
    last = int(inputs["decoder_input_ids"][0, -1])
    changed["decoder_input_ids"][0, -1] = 3 if last != 3 else 4
    with torch.no_grad():
        cached = [model(**x).logits[0, :-1] for x in (inputs, changed)]
    uncached = [oc.reference_logits(model, x)[0, :-1] for x in (inputs, changed)]
    assert model.config.use_cache
    torch.testing.assert_close(uncached[0], uncached[1], rtol=0, atol=0)
    assert not torch.equal(cached[0], cached[1])


def _onnx_packages():
    for module in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(module)


@pytest.mark.slow
def test_onnxruntime_reproduces_the_three_classes_logits(capsys, tmp_path):
    _onnx_packages()
    assert oc.main(["--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "onnx")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert sorted(r["class"] for r in rows) == sorted(oc.CLASSES.values())
    for row in rows:
        assert row["ok"] and 0 <= row["diff_export_shapes"] <= 1e-4 and 0 <= row["diff_other_shapes"] <= 1e-4, row
    assert all((tmp_path / "onnx" / f"{kind}.onnx").is_file() for kind in oc.CLASSES)
    assert "| tiny fsmt (random) | FSMTForConditionalGeneration |" in capsys.readouterr().out


@pytest.mark.slow
def test_fsmt_without_its_decoder_padding_mask_fails_to_export_and_says_so(tiny, tmp_path, monkeypatch):
    """The reason the traced forward passes FSMT's decoder padding mask: without it, transformers builds it
    under ``if not mask.any()``, which torch.export refuses (a data-dependent branch); the row says so."""
    _onnx_packages()
    monkeypatch.setattr(oc, "DECODER_PAD_MASK", frozenset())
    folder = tmp_path / "fsmt"
    tiny["fsmt"].save_pretrained(folder)
    row = oc.check(folder, tmp_path, 1e-4, 1, "fsmt")
    assert not row["ok"] and row["error"].startswith("GuardOnDataDependentSymNode"), row
