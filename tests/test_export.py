"""deepinit-export against the real CTranslate2 and stock fairseq: every family of docs/export.md's table.

For every family (and option variant) that a target takes, translation and language model, at tiny dims
with every exported parameter away from its init (tests/export_cases.py):

- ``--to ctranslate2``: CTranslate2's teacher-forced log-probabilities (float32) equal the plugin model's
  (float64) to float round-off, the bound being the plugin's own float32 deviation on the same tokens
  times :data:`ROUNDOFF_FACTOR` (two float32 computations of one function; measured ratios 0.3-3.6); and
  beam 5 with the options of :mod:`fairseq_deepinit.export.decoding` gives fairseq's ``SequenceGenerator``'s
  outputs token for token;
- ``--to fairseq``: the written checkpoint, reloaded by fairseq's own loader into fairseq's own class, gives
  the plugin model's log-probabilities to the same bound;
- every refused (family, target) stops with one ``cannot export to <target>: ...`` before anything is written.
"""

from __future__ import annotations

import os

import pytest
import torch
from export_cases import build_case, case_id, cases, resolved, write_checkpoint
from fairseq.sequence_generator import SequenceGenerator

from fairseq_deepinit.errors import ExportError
from fairseq_deepinit.export import decoding, run, scoring, source, to_fairseq
from fairseq_deepinit.export.route import CTRANSLATE2, FAIRSEQ, TARGETS, classify

pytest.importorskip("ctranslate2")

ROUNDOFF_FACTOR = 10
BEAM = decoding.FairseqDecoding(beam=5, max_len_b=30)
ALL = cases()


ROUTES = {case: classify(resolved(case)) for case in ALL}


def _targets(target: str, refused: bool):
    return [c for c in ALL if (target in ROUTES[c].reasons) == refused]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``case -> (model, args, CTranslate2 folder, vocabularies)``, each exported once per module."""
    cache = {}

    def get(case):
        if case not in cache:
            model, args = build_case(case)
            folder = tmp_path_factory.mktemp(case_id(case).replace(":", "_"))
            ckpt, data = write_checkpoint(model, args, folder)
            if CTRANSLATE2 not in ROUTES[case].reasons:
                run.export_ct2(str(ckpt), str(folder / "ct2"), data=str(data), check=False)
            vocabularies = [decoding_vocabulary(model)] * (1 if getattr(model, "encoder", None) is None else 2)
            cache[case] = (model, args, str(folder / "ct2"), vocabularies, ckpt)
        return cache[case]

    return get


def decoding_vocabulary(model):
    return ["<blank>" if t == "<pad>" else t for t in model.decoder.dictionary.symbols]


def roundoff_bound(model, args, sentences) -> tuple:
    """``(plugin float64 scores, bound)``: the bound is ROUNDOFF_FACTOR times the plugin's own float32 deviation."""
    m64 = source.build_plugin_model(model.state_dict(), args, torch.float64)
    m32 = source.build_plugin_model(model.state_dict(), args, torch.float32)
    p64 = scoring.plugin_scores(m64, sentences)
    d32 = scoring.max_difference(p64, scoring.plugin_scores(m32, sentences))
    return p64, m64, ROUNDOFF_FACTOR * max(d32, 1e-7)


@pytest.mark.parametrize("case", _targets(CTRANSLATE2, refused=False), ids=case_id)
def test_ct2_log_probs_equal_the_plugins_to_float_roundoff(case, exported):
    model, args, folder, vocabularies, _ = exported(case)
    sentences = scoring.random_sentences(model, n=8, seed=3)
    p64, _m64, bound = roundoff_bound(model, args, sentences)
    ct2 = scoring.ct2_scores(scoring.load_ct2(folder, ROUTES[case].lm), vocabularies, sentences)
    assert scoring.max_difference(p64, ct2) <= bound


def fairseq_beam(model, sources, decoding_options: decoding.FairseqDecoding, lm: bool):
    """fairseq's SequenceGenerator on the plugin model (float32), one sentence at a time (``max_len`` per length)."""
    d = model.decoder.dictionary
    gen = SequenceGenerator(
        [model],
        d,
        beam_size=decoding_options.beam,
        max_len_a=decoding_options.max_len_a,
        max_len_b=decoding_options.max_len_b,
        min_len=decoding_options.min_len,
        len_penalty=decoding_options.lenpen,
    )
    out = []
    for src in sources:
        if lm:
            tokens = torch.tensor([src])
            sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([len(src)])}}
            hypo = gen.generate([model], sample, prefix_tokens=tokens)[0][0]
        else:
            tokens = torch.tensor([[*src, d.eos()]])
            sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([tokens.size(1)])}}
            hypo = gen.generate([model], sample)[0][0]
        out.append([d[i] for i in hypo["tokens"].tolist()[:-1]])
    return out


@pytest.mark.parametrize("case", _targets(CTRANSLATE2, refused=False), ids=case_id)
def test_ct2_beam5_outputs_equal_fairseq_generate(case, exported):
    model, _args, folder, vocabularies, _ = exported(case)
    lm = ROUTES[case].lm
    sentences = scoring.random_sentences(model, n=6, seed=5, max_len=8)
    words = [[vocabularies[0][i] for i in (tgt if lm else src)] for src, tgt in sentences]
    ids = [tgt if lm else src for src, tgt in sentences]
    want = fairseq_beam(model, ids, BEAM, lm)
    ct2 = scoring.load_ct2(folder, lm)
    if lm:
        got, redone, at_limit = decoding.generate_tokens(ct2, words, BEAM)
    else:
        got, redone, at_limit = decoding.translate_tokens(ct2, words, BEAM)
    assert all(len(w) < BEAM.max_len_b for w in want)  # every sentence ended before the length limit
    assert [h[0] for h in got] == want
    assert redone == 0 and at_limit == []


@pytest.mark.parametrize("case", _targets(FAIRSEQ, refused=False), ids=case_id)
def test_stock_fairseq_export_equals_the_plugin(case, exported, tmp_path):
    model, args, _folder, _vocabularies, ckpt = exported(case)
    summary = run.export_fairseq(str(ckpt), str(tmp_path / "stock.pt"), check=False)
    assert summary["route"].fairseq == ("fold" if ROUTES[case].folds else "stock")
    m64 = source.build_plugin_model(model.state_dict(), args, torch.float64)
    m32 = source.build_plugin_model(model.state_dict(), args, torch.float32)
    batch = to_fairseq._random_batch(m64)
    d32 = (to_fairseq.log_probs(m64, batch) - to_fairseq.log_probs(m32, batch)).abs()[batch[3]].max().item()
    diff = to_fairseq.check_stock_file(str(tmp_path / "stock.pt"), m64, ROUNDOFF_FACTOR * max(d32, 1e-7))
    assert diff <= ROUNDOFF_FACTOR * max(d32, 1e-7)
    state = torch.load(tmp_path / "stock.pt", weights_only=True)
    assert state["args"] is None and state["cfg"]["model"]["_name"] in ("transformer", "transformer_lm")


REFUSED = [(c, t) for t in (FAIRSEQ, CTRANSLATE2) for c in _targets(t, refused=True)]


@pytest.mark.kernel_independent
@pytest.mark.parametrize("case,target", REFUSED, ids=lambda x: case_id(x) if isinstance(x, tuple) else x)
def test_refused_families_stop_before_anything_is_written(case, target, tmp_path):
    model, args = build_case(case)
    ckpt, data = write_checkpoint(model, args, tmp_path)
    out = tmp_path / ("out.pt" if target == FAIRSEQ else "out-ct2")
    extra = {"data": str(data)} if target == CTRANSLATE2 else {}
    with pytest.raises(ExportError) as e:
        run.export(str(ckpt), str(out), target, **extra)
    message = str(e.value)
    assert message.startswith(f"cannot export to {target}: ") and "\n" not in message
    assert message.startswith(f"cannot export to {target}: {ROUTES[case].reasons[target]}")
    other = CTRANSLATE2 if target == FAIRSEQ else FAIRSEQ
    assert message.endswith(f"; --to {other} exports it exactly") == (other not in ROUTES[case].reasons)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.kernel_independent
def test_every_named_family_is_in_a_case():
    from fairseq_deepinit.architectures import FAMILIES

    assert {c[0] for c in ALL} == set(FAMILIES)


@pytest.mark.kernel_independent
def test_a_method_without_an_export_declaration_is_refused(monkeypatch):
    """A record added without ``export`` is refused by the route for every target, naming its option; so is a
    record whose declaration is taken away (the declaration decides, not a table of the exporter's)."""
    import dataclasses

    from fairseq_deepinit.methods import METHODS
    from fairseq_deepinit.methods.record import Method, Option

    new = Method(
        name="brand_new",
        title="Brand New",
        paper="-",
        summary="-",
        enabled_by="brand_new",
        options=(Option("brand_new", bool, False, "a method the exporters were not taught"),),
    )
    monkeypatch.setitem(METHODS, new.name, new)
    args = resolved(("preln", (), False))
    args.brand_new = True
    want = "--brand-new (Brand New): the export does not carry this option yet"
    assert classify(args).reasons == {target: want for target in TARGETS}

    args = resolved(("lnscale", (), False))
    assert classify(args).fairseq == "fold"
    monkeypatch.setitem(METHODS, "lnscale", dataclasses.replace(METHODS["lnscale"], export=None))
    want = "--layernorm-scaling (LayerNorm Scaling): the export does not carry this option yet"
    assert classify(args).reasons == {target: want for target in TARGETS}


@pytest.mark.kernel_independent
def test_every_declared_fold_step_has_its_function_in_order():
    from fairseq_deepinit.export.fold import STEPS
    from fairseq_deepinit.methods.exporting import FOLD_STEPS

    assert tuple(STEPS) == FOLD_STEPS
