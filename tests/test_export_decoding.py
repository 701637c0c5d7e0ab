"""CTranslate2 translation of an exported trained model gives fairseq-generate's hypotheses, through the two
ways users take: docs/export.md's Python example (extracted from the page and run as written) and
``scripts/translate_ct2.py``'s code (:func:`deepinit_tools.ct2_translate.translate_bpe`), both with
:func:`fairseq_deepinit.export.decoding.translate_tokens`' defaults.

The models are the tiny trained checkpoints of tests/fixtures/v010 (30 updates of fairseq-train), whose
fairseq-generate hypotheses (beam 3, batches of 8) are stored beside them and checked against today's
fairseq-generate by tests/test_compat_v010.py. With ``exact_first_step=False`` (the former default) DeepNorm
gives 18 of the 20 and TwT (Pre-LN with ScaleNorm and FixNorm) none.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO

pytest.importorskip("ctranslate2")

FIXTURES = REPO / "tests" / "fixtures" / "v010"
DATA = FIXTURES / "data-bin"


def fixture_test_split():
    """``(source sentences as tokens, target lengths)`` of the fixtures' test split."""
    from fairseq.data import Dictionary, data_utils

    src_dict = Dictionary.load(str(DATA / "dict.src.txt"))
    tgt_dict = Dictionary.load(str(DATA / "dict.tgt.txt"))
    src = data_utils.load_indexed_dataset(str(DATA / "test.src-tgt.src"), src_dict)
    tgt = data_utils.load_indexed_dataset(str(DATA / "test.src-tgt.tgt"), tgt_dict)
    sources = [[src_dict[i] for i in src[k].tolist()[:-1]] for k in range(len(src))]
    return sources, [len(tgt[k]) for k in range(len(tgt))]


def export_fixture(case: str, out: Path) -> Path:
    from fairseq_deepinit.export import cli

    assert cli.main([str(FIXTURES / f"{case}.pt"), str(out), "--to", "ctranslate2", "--data", str(DATA)]) == 0
    return out


def fairseq_generate_hypotheses(case: str) -> list:
    """fairseq-generate's best hypothesis per test sentence (beam 3), in the test split's order."""
    stored = json.loads((FIXTURES / f"{case}.json").read_text())["hypotheses"]
    return [stored[str(k)][1] for k in range(len(stored))]


def docs_example() -> str:
    text = (REPO / "docs" / "export.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/export.md should hold one Python example"
    return blocks[0]


def sequence_generator_hypotheses(case: str, sources, beam: int) -> list:
    """fairseq's SequenceGenerator on the fixture's model, one sentence at a time."""
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    (model,), _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(FIXTURES / f"{case}.pt")], arg_overrides={"data": str(DATA)}
    )
    model.eval()
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    generator = SequenceGenerator([model], tgt_dict, beam_size=beam)
    out = []
    for words in sources:
        tokens = torch.tensor([[src_dict.index(w) for w in words] + [src_dict.eos()]])
        sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([tokens.size(1)])}}
        best = generator.generate([model], sample)[0][0]["tokens"].tolist()[:-1]
        out.append(" ".join(tgt_dict[i] for i in best))
    return out


def test_the_python_example_of_docs_export_runs_as_written(tmp_path, monkeypatch, capsys):
    sources, _ = fixture_test_split()
    export_fixture("deepnorm", tmp_path / "model-ct2")
    (tmp_path / "sources.bpe").write_text("".join(" ".join(s) + "\n" for s in sources), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(docs_example(), "docs/export.md", "exec"), {"__name__": "docs_example"})
    printed = capsys.readouterr().out.splitlines()
    assert printed == sequence_generator_hypotheses("deepnorm", sources, beam=5)


@pytest.mark.parametrize("case", ["deepnorm", "twt"])
def test_translate_ct2_gives_fairseq_generates_hypotheses(case, tmp_path):
    from deepinit_tools.ct2_translate import load_translator, translate_bpe
    from deepinit_tools.prepare_bible import detokenize
    from fairseq_deepinit.export.decoding import FairseqDecoding

    sources, target_lengths = fixture_test_split()
    translator = load_translator(str(export_fixture(case, tmp_path / "ct2")))
    got = translate_bpe(translator, [" ".join(s) for s in sources], FairseqDecoding(beam=3), 8, target_lengths)
    assert got.hypotheses == [detokenize(h) for h in fairseq_generate_hypotheses(case)]
    assert got.redone == 0 and got.at_limit == []
