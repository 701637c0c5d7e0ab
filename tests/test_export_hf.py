"""deepinit-export --to huggingface against the real transformers: every family of docs/export.md's table.

For every family (and option variant) the route sends to transformers, translation and language model, at tiny
dims with every exported parameter away from its init (tests/export_cases.py):

- the written folder, reloaded by transformers' auto class, gives the plugin model's teacher-forced
  log-probabilities (float64) to float round-off: the bound is the plugin's own float32 deviation on the same
  tokens times :data:`ROUNDOFF_FACTOR`, as for the other targets (tests/test_export.py);
- its class is the one the route names (FSMT for Post-LN, M2M100 for Pre-LN, XGLM for a Pre-LN language model);
- batched and right-padded (as a tokenizer pads), it scores every sentence as alone;
- ``generate`` with the written generation config gives fairseq's ``SequenceGenerator``'s beam-5 hypotheses;
- a Python in which fairseq and the plugin cannot be imported loads it and generates the same;
- every refused family stops with one ``cannot export to huggingface: ...`` line before anything is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from export_cases import build_case, case_id, cases, resolved, write_checkpoint
from fairseq.sequence_generator import SequenceGenerator

from fairseq_deepinit.errors import ExportError
from fairseq_deepinit.export import run, scoring, source, to_hf
from fairseq_deepinit.export.route import FAIRSEQ, HF_CLASSES, HUGGINGFACE, classify

transformers = pytest.importorskip("transformers")

ROUNDOFF_FACTOR = 10
ALL = cases()
ROUTES = {case: classify(resolved(case)) for case in ALL}
TAKEN = [c for c in ALL if HUGGINGFACE not in ROUTES[c].reasons]
REFUSED = [c for c in ALL if HUGGINGFACE in ROUTES[c].reasons]
#: one family per class, and the activations transformers names differently
SEARCHED = [
    ("postln", (), False),
    ("admin", (), False),
    ("preln", (), False),
    ("preln", ("--activation-fn", "gelu_accurate"), False),
    ("preln", ("--share-all-embeddings",), False),
    ("postln", ("--share-decoder-input-output-embed",), False),
    ("postln", ("--activation-fn", "gelu"), False),
    ("preln", ("--activation-fn", "gelu_fast"), True),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``case -> (model, args, folder)``, each exported once per module (checked at the export's default 1e-4)."""
    cache = {}

    def get(case):
        if case not in cache:
            model, args = build_case(case)
            folder = tmp_path_factory.mktemp(case_id(case).replace(":", "_"))
            ckpt, data = write_checkpoint(model, args, folder)
            summary = run.export_hf(str(ckpt), str(folder / "hf"), data=str(data))
            cache[case] = (model, args, str(folder / "hf"), summary)
        return cache[case]

    return get


@pytest.mark.parametrize("case", TAKEN, ids=case_id)
def test_transformers_log_probs_equal_the_plugins_to_float_roundoff(case, exported):
    model, args, folder, summary = exported(case)
    m64 = source.build_plugin_model(model.state_dict(), args, torch.float64)
    m32 = source.build_plugin_model(model.state_dict(), args, torch.float32)
    sentences = scoring.random_sentences(m64)
    d32 = scoring.max_difference(scoring.plugin_scores(m64, sentences), scoring.plugin_scores(m32, sentences))
    bound = ROUNDOFF_FACTOR * max(d32, 1e-7)
    assert to_hf.check_hf_dir(folder, m64, bound) <= bound
    hf = to_hf.load_hf(folder, ROUTES[case].lm)
    want = HF_CLASSES[(ROUTES[case].lm, next(iter(ROUTES[case].placements.values())))]
    assert type(hf).__name__ == to_hf.CLASSES[want][0] == summary["hf_class"]


@pytest.mark.parametrize("case", [c for c in TAKEN if c[0] in ("postln", "preln") and not c[1]], ids=case_id)
def test_a_right_padded_batch_scores_each_sentence_as_alone(case, exported):
    model, args, folder, _summary = exported(case)
    hf = to_hf.load_hf(folder, ROUTES[case].lm)
    sentences = scoring.random_sentences(model, n=4, seed=3)
    alone = to_hf.hf_scores(hf, sentences)
    pad, eos = hf.config.pad_token_id, hf.config.eos_token_id
    width = max(len(s) for s, _ in sentences) + 1
    if ROUTES[case].lm:
        ids = [[eos, *t[:-1]] for _s, t in sentences]
        n = max(map(len, ids))
        inputs = torch.tensor([x + [pad] * (n - len(x)) for x in ids])
        logits = hf(input_ids=inputs, attention_mask=inputs.ne(pad).long(), use_cache=False).logits
        golds = [t for _s, t in sentences]
    else:
        src = torch.tensor([[*s, eos] + [pad] * (width - len(s) - 1) for s, _t in sentences])
        n = max(len(t) for _s, t in sentences) + 1
        dec = torch.tensor([[eos, *t] + [pad] * (n - len(t) - 1) for _s, t in sentences])
        logits = hf(input_ids=src, attention_mask=src.ne(pad).long(), decoder_input_ids=dec, use_cache=False).logits
        golds = [[*t, eos] for _s, t in sentences]
    lp = torch.log_softmax(logits.to(torch.float64), -1)
    batched = [lp[i, : len(g)].gather(-1, torch.tensor(g)[:, None])[:, 0] for i, g in enumerate(golds)]
    assert scoring.max_difference(alone, batched) < 1e-5


#: a language model's prompt: fairseq divides (prompt + continuation) log-probabilities by (prompt + continuation)
#: length^lenpen, transformers the continuation's by its length^lenpen, so beams may rank finished hypotheses
#: differently (docs/export.md); greedy search is one definition in both
LM_BEAM = 1


def fairseq_beam(model, sources, lm: bool, max_len_b: int):
    """fairseq-generate's search (beam 5, lenpen 1, min-len 1) on the plugin model, one sentence at a time."""
    d = model.decoder.dictionary
    gen = SequenceGenerator([model], d, beam_size=LM_BEAM if lm else 5, max_len_b=max_len_b, min_len=1)
    out = []
    for src in sources:
        tokens = torch.tensor([src if lm else [*src, d.eos()]])
        sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([tokens.size(1)])}}
        hypo = gen.generate([model], sample, prefix_tokens=tokens if lm else None)[0][0]
        out.append(hypo["tokens"].tolist()[len(src) if lm else 0 : -1])
    return out


def hf_beam(hf, sources, lm: bool, max_len_b: int):
    """transformers' ``generate`` with the written generation config, the length limit as fairseq's."""
    eos = hf.config.eos_token_id
    out = []
    for src in sources:
        if lm:
            ids = hf.generate(torch.tensor([[eos, *src]]), max_length=len(src) + 1 + max_len_b + 1, num_beams=LM_BEAM)
            out.append([t for t in ids[0, len(src) + 1 :].tolist() if t != eos])
        else:
            ids = hf.generate(torch.tensor([[*src, eos]]), max_length=max_len_b + 2)
            out.append([t for t in ids[0, 1:].tolist() if t != eos])
    return out


@pytest.mark.parametrize("case", SEARCHED, ids=case_id)
def test_generate_with_the_written_config_equals_fairseq_generate(case, tmp_path):
    model, args = build_case(case)
    ckpt, data = write_checkpoint(model, args, tmp_path)
    run.export_hf(str(ckpt), str(tmp_path / "hf"), data=str(data))
    config = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (config["num_beams"], config["length_penalty"], config["early_stopping"]) == (5, 1.0, True)
    sentences = scoring.random_sentences(model, n=6, seed=5, max_len=8)
    sources = [t if case[2] else s for s, t in sentences]
    m32 = source.build_plugin_model(model.state_dict(), args, torch.float32)
    want = fairseq_beam(m32, sources, case[2], max_len_b=30)
    assert all(len(w) < 30 for w in want)  # every hypothesis ended before the limit
    assert hf_beam(to_hf.load_hf(str(tmp_path / "hf"), case[2]), sources, case[2], 30) == want


CHILD = """
import importlib.abc, json, sys
class NoFairseq(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq", "fairseq_deepinit"):
            raise ImportError(f"{name} is not installed in this Python")
sys.meta_path.insert(0, NoFairseq())
import torch, transformers
folder, lm, sources = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3])
auto = transformers.AutoModelForCausalLM if lm else transformers.AutoModelForSeq2SeqLM
model = auto.from_pretrained(folder).eval()
eos = model.config.eos_token_id
out = []
for src in sources:
    ids = torch.tensor([[eos, *src]] if lm else [[*src, eos]])
    gen = model.generate(ids, max_length=(len(src) + 1 if lm else 1) + 31, num_beams=1 if lm else 5)
    out.append([t for t in gen[0, len(src) + 1 if lm else 1 :].tolist() if t != eos])
assert "fairseq" not in sys.modules and "fairseq_deepinit" not in sys.modules
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", [("admin", (), False), ("preln", (), True)], ids=case_id)
def test_a_python_without_fairseq_loads_and_generates_the_same(case, tmp_path):
    model, args = build_case(case)
    ckpt, data = write_checkpoint(model, args, tmp_path)
    run.export_hf(str(ckpt), str(tmp_path / "hf"), data=str(data))
    sources = [t if case[2] else s for s, t in scoring.random_sentences(model, n=3, seed=5, max_len=8)]
    want = hf_beam(to_hf.load_hf(str(tmp_path / "hf"), case[2]), sources, case[2], 30)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-c", CHILD, str(tmp_path / "hf"), "1" if case[2] else "0", json.dumps(sources)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want


@pytest.mark.kernel_independent
@pytest.mark.parametrize("case", REFUSED, ids=case_id)
def test_refused_families_stop_before_anything_is_written(case, tmp_path):
    model, args = build_case(case)
    ckpt, data = write_checkpoint(model, args, tmp_path)
    out = tmp_path / "out-hf"
    with pytest.raises(ExportError) as e:
        run.export(str(ckpt), str(out), HUGGINGFACE, data=str(data))
    message = str(e.value)
    assert message.startswith(f"cannot export to huggingface: {ROUTES[case].reasons[HUGGINGFACE]}")
    assert "\n" not in message
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.kernel_independent
def test_what_stock_fairseq_refuses_transformers_refuses_too():
    for case in ALL:
        if FAIRSEQ in ROUTES[case].reasons:
            assert ROUTES[case].reasons[HUGGINGFACE] == ROUTES[case].reasons[FAIRSEQ]


@pytest.mark.kernel_independent
def test_separate_vocabularies_of_different_sizes_are_refused_for_m2m100(tmp_path):
    from conftest import make_dictionary

    model, args = build_case(("preln", (), False))
    ckpt, data = write_checkpoint(model, args, tmp_path)
    state = torch.load(ckpt, weights_only=False)
    bigger = make_dictionary(60)
    rows = len(bigger)
    state["model"]["decoder.embed_tokens.weight"] = torch.randn(rows, 32)
    state["model"]["decoder.output_projection.weight"] = state["model"]["decoder.embed_tokens.weight"]
    torch.save(state, ckpt)
    bigger.save(str(data / "dict.tgt.txt"))
    with pytest.raises(ExportError, match="M2M100 has one vocabulary size"):
        run.export(str(ckpt), str(tmp_path / "out"), HUGGINGFACE, data=str(data))
    assert not (tmp_path / "out").exists()


@pytest.mark.kernel_independent
def test_quantization_is_refused_for_huggingface(tmp_path):
    with pytest.raises(ExportError, match="--quantization applies to --to ctranslate2 only"):
        run.export("x.pt", str(tmp_path / "out"), HUGGINGFACE, quantization="int8")
