"""``--norm-placement`` (post, pre, peri, reordered) against the independent port of OLMo-core's blocks.

The port (``tests/ports/norm_placement.py``) is written from OLMo-core @ fa6c501
``src/olmo_core/nn/transformer/block.py:144-153`` (pre), ``293-309`` (reordered), ``312-373`` (peri).
Here: a plugin layer's output with the port's computation on the same weights (encoder layer, decoder
layer with cross-attention, decoder-only layer; float64 and float32; LayerNorm, RMSNorm, ScaleNorm),
``post``/``pre`` bit-identical to fairseq's ``--*-normalize-before``, the norms each placement builds
(peri's output norms, every stack's final norm but post's), the refusals, and fairseq-train / generate /
checkpoint reload for translation and language modelling.
"""

from __future__ import annotations

import re

import pytest
import torch
from fairseq.models.transformer import TransformerConfig
from ports.common import AttnWeights, FFNWeights, NormSpec
from ports.norm_placement import NORMS_PER_SUBLAYER, decoder_layer, encoder_layer, has_final_norm
from test_lm import TRAIN as LM_TRAIN

from conftest import TINY_DIMS, USER_DIR, build_model, run_cli, tiny_batch
from fairseq_deepinit import options, plan
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.layers import DeepInitDecoderLayer, DeepInitEncoderLayer
from fairseq_deepinit.modules.stacks import ENCODER, decoder_kind

PLACEMENTS = ("post", "pre", "peri", "reordered")
DIMS = ["--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0", "--attention-dropout", "0"]


def _layers(placement: str, norm_type: str, dtype: torch.dtype, seed: int = 0):
    """An encoder layer, a decoder layer with cross-attention and a decoder-only layer, built as the model
    builds them, with random norm parameters (a misplaced norm shows) in ``dtype``."""
    _, args = build_model("deepinit_tiny", "--norm-placement", placement, "--norm-type", norm_type, *DIMS)
    cfg = TransformerConfig.from_namespace(args)
    spec = plan.spec_of(cfg)
    torch.manual_seed(seed)
    layers = (
        DeepInitEncoderLayer(cfg, plan.layer_plan(spec, ENCODER, 1)),
        DeepInitDecoderLayer(cfg, plan.layer_plan(spec, decoder_kind(cross_attention=True), 1)),
        DeepInitDecoderLayer(cfg, plan.layer_plan(spec, decoder_kind(cross_attention=False), 1), no_encoder_attn=True),
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in layers:
            layer.to(dtype).eval()
            for name, p in layer.named_parameters():
                if "norm" in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.1 + (1.0 if "bias" not in name else 0))
    return layers


def _norm(module, norm_type: str):
    """The port's norm with the module's parameters; ScaleNorm (not in the port) is the plugin's module."""
    return module if norm_type == "scalenorm" else NormSpec.from_module(module)


def _port_norms(layer, placement: str, norm_type: str) -> dict:
    """The port's ``{"attn.in": ..., "ffn.out": ...}`` from the plugin layer's attributes: the sub-layer's
    norm in fairseq's slot is the input norm (pre, peri) or the one output norm (post, reordered);
    Peri-LN's output norm is the layer's ``*_out_norm``."""
    slots = (("attn", "self_attn_layer_norm", "self_attn_out_norm"),
             ("cross", "encoder_attn_layer_norm", "encoder_attn_out_norm"),
             ("ffn", "final_layer_norm", "ffn_out_norm"))  # fmt: skip
    out = {}
    for sub, slot, extra in slots:
        if getattr(layer, slot, None) is None:
            continue
        roles = NORMS_PER_SUBLAYER[placement]
        out[f"{sub}.{roles[0]}"] = _norm(getattr(layer, slot), norm_type)
        if placement == "peri":
            out[f"{sub}.out"] = _norm(getattr(layer, extra), norm_type)
    return out


# fairseq's explicit attention path (cross-attention: static_kv) computes the softmax in float32 even for
# float64 inputs (fairseq/utils.py:518), a relative error up to 2**-24 on the probabilities; the port's
# attention computes it in float64. Through the following projections and norms (weights and activations
# of O(1-10), gains ~1) that stays below 1e-6 (as in tests/test_ports.py). In float32 both paths round
# every op to 2**-24 relative; sums of 64-128 terms and ~10 chained ops, amplified by at most ~10 by
# the norms' 1/rms on O(1) inputs, stay below 2e-5.
TOL = {torch.float64: dict(rtol=1e-6, atol=1e-6), torch.float32: dict(rtol=2e-5, atol=2e-5)}


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm", "scalenorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_layer_equals_the_port(placement, dtype, norm_type):
    enc, dec, lm = _layers(placement, norm_type, dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 64, generator=g, dtype=dtype)
    mem = torch.randn(2, 4, 64, generator=g, dtype=dtype)
    future = torch.full((5, 5), float("-inf"), dtype=dtype).triu(1)
    with torch.no_grad():
        got = enc(x.transpose(0, 1), None).transpose(0, 1)
        want = encoder_layer(x, AttnWeights.from_module(enc.self_attn), FFNWeights.from_module(enc),
                             _port_norms(enc, placement, norm_type), placement, 2)  # fmt: skip
        torch.testing.assert_close(got, want, **TOL[dtype])
        got = dec(x.transpose(0, 1), mem.transpose(0, 1), None, self_attn_mask=future)[0].transpose(0, 1)
        want = decoder_layer(x, mem, AttnWeights.from_module(dec.self_attn),
                             AttnWeights.from_module(dec.encoder_attn), FFNWeights.from_module(dec),
                             _port_norms(dec, placement, norm_type), placement, 2)  # fmt: skip
        torch.testing.assert_close(got, want, **TOL[dtype])
        got = lm(x.transpose(0, 1), None, None, self_attn_mask=future)[0].transpose(0, 1)
        want = decoder_layer(x, None, AttnWeights.from_module(lm.self_attn), None, FFNWeights.from_module(lm),
                             _port_norms(lm, placement, norm_type), placement, 2)  # fmt: skip
        torch.testing.assert_close(got, want, **TOL[dtype])


def test_output_norm_comes_before_the_dropout():
    """OLMo-core drops out the normalised branch (residual_stream.py:18-19): with dropout p, the branch's
    contribution ``h - x`` is the output norm's value zeroed or scaled by 1/(1-p), never renormalised."""
    _, args = build_model("deepinit_tiny", "--norm-placement", "reordered", "--norm-type", "rmsnorm", *DIMS)
    args.dropout = 0.5
    cfg = TransformerConfig.from_namespace(args)
    torch.manual_seed(0)
    layer = DeepInitEncoderLayer(cfg, plan.layer_plan(plan.spec_of(cfg), ENCODER, 1)).double().train()
    x = torch.randn(5, 2, 64, dtype=torch.float64)
    captured = {}
    layer.self_attn_layer_norm.register_forward_hook(lambda m, i, o: captured.setdefault("n", o))
    layer.final_layer_norm.register_forward_hook(lambda m, i, o: None)
    layer.residuals["self_attn"].register_forward_hook(lambda m, i, o: captured.setdefault("branch", i[0]))
    layer(x, None)
    n, branch = captured["n"], captured["branch"]
    kept = branch != 0
    torch.testing.assert_close(branch[kept], 2.0 * n[kept], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "arch,placement,flags",
    [("postln_iwslt_de_en", "post", []), ("preln_iwslt_de_en", "pre", []),
     ("deepinit_tiny", "pre", ["--encoder-normalize-before", "--decoder-normalize-before"])],
)  # fmt: skip
def test_post_and_pre_are_fairseqs_flags_bit_for_bit(arch, placement, flags):
    """``--norm-placement post|pre`` builds the model of fairseq's ``--*-normalize-before`` flags: same
    state dict (keys, order, values) and the same output bits."""
    dims = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32"]
    a, args_a = build_model(arch, *dims, *flags)
    b, args_b = build_model(arch, *dims, *flags, "--norm-placement", placement)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    a.eval(), b.eval()
    assert torch.equal(a(**tiny_batch())[0], b(**tiny_batch())[0])
    assert args_a.encoder_normalize_before == args_b.encoder_normalize_before == (placement == "pre")
    assert options.describe(args_a) == options.describe(args_b)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_norms_each_placement_builds(placement):
    model, args = build_model("deepinit_tiny", "--norm-placement", placement)
    for stack in (model.encoder, model.decoder):
        assert (stack.layer_norm is not None) == has_final_norm(placement)  # pre/peri/reordered keep it
        for layer in stack.layers:
            assert layer.placement == placement
            outs = [getattr(layer, n) for n in layer.OUT_NORMS]
            assert all(o is not None for o in outs) == (placement == "peri")
            assert all(o is None for o in outs) == (placement != "peri")
            for o in outs:  # OLMo-core's norms start as the identity map (weight 1, bias 0), as fairseq's do
                if o is not None:
                    assert torch.equal(o.weight, torch.ones_like(o.weight)) and not o.bias.any()
    keys = set(model.state_dict())
    assert ("decoder.layers.0.encoder_attn_out_norm.weight" in keys) == (placement == "peri")
    assert f"decoder={placement}-norm" in options.describe(args)


def test_peri_adds_one_norm_per_sublayer_reordered_none():
    def n_params(placement):
        model, _ = build_model("deepinit_tiny", "--norm-placement", placement)
        return sum(p.numel() for p in model.parameters())

    d, sublayers = 64, 2 * 2 + 2 * 3  # 2 encoder layers x 2 sub-layers, 2 decoder layers x 3
    assert n_params("reordered") == n_params("pre")
    assert n_params("peri") == n_params("pre") + sublayers * 2 * d  # LayerNorm: weight and bias


def test_embedding_norm_is_fairseqs_layernorm_embedding_of_the_norm_type():
    model, _ = build_model("periln_iwslt_de_en", *DIMS, "--layernorm-embedding", "--norm-type", "rmsnorm")
    for stack in (model.encoder, model.decoder):
        assert type(stack.layernorm_embedding).__name__ == "RMSNorm"


def test_families_and_matt():
    model, args = build_model("reordered_iwslt_de_en", *DIMS, "--decoder-layer-type", "matt")
    assert args.norm_placement == "reordered" and all(lay.placement == "reordered" for lay in model.decoder.layers)
    model, args = build_model("periln_iwslt_de_en", *DIMS, "--decoder-layer-type", "matt")
    assert all(lay.matt_out_norm is not None and lay.ffn_out_norm is not None for lay in model.decoder.layers)
    model.eval()
    assert torch.isfinite(model(**tiny_batch())[0]).all()


BAD = [
    ("deepinit_tiny", ["--norm-placement", "peri", "--init-scheme", "deepnorm"], "remove --norm-placement peri"),
    ("b2t_iwslt_de_en", ["--norm-placement", "reordered"], "Post-LN only"),
    ("deepinit_tiny", ["--norm-placement", "post", "--decoder-normalize-before"], "contradicts"),
    ("periln_iwslt_de_en", ["--norm-type", "none"], "--norm-type none"),
    ("reordered_iwslt_de_en", ["--subln"], "use --norm-placement pre"),
    ("periln_iwslt_de_en", ["--scale-attn", "--scale-fc"], "--scale-attn --scale-fc are defined on Pre-LN"),
]


@pytest.mark.parametrize("arch,cli,says", BAD, ids=[f"{a}{''.join(c)}" for a, c, _ in BAD])
def test_bad_combinations_stop_with_one_line(arch, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(arch, *DIMS, *cli)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_family_placement_is_a_default_the_command_line_overrides():
    """The Pre-LN families set ``--norm-placement pre`` (the spec's placement axis, not fairseq's booleans): a given
    ``--norm-placement`` wins, as every other value of a family does."""
    _, args = build_model("preln_iwslt_de_en", *DIMS)
    assert args.norm_placement == "pre" and args.encoder_normalize_before and args.decoder_normalize_before
    model, args = build_model("preln_iwslt_de_en", *DIMS, "--norm-placement", "post")
    assert args.norm_placement == "post" and not (args.encoder_normalize_before or args.decoder_normalize_before)
    assert all(lay.placement == "post" for lay in (*model.encoder.layers, *model.decoder.layers))
    assert model.encoder.layer_norm is None and model.decoder.layer_norm is None


def test_a_checkpoint_whose_family_gave_the_flags_resumes_under_the_family_placement():
    """A checkpoint written while the Pre-LN families gave fairseq's normalize-before flags (``norm_placement``
    stored as ``auto``) builds the same stacks as the family's ``--norm-placement pre`` and resumes without a
    difference; a real change of placement is still one."""
    import copy

    from fairseq_deepinit.checkpoints import config_check

    _, current = build_model("preln_iwslt_de_en", *DIMS)
    saved = copy.copy(current)
    saved.norm_placement = "auto"  # what the family stored when it set the flags
    placements = [[s.placement for s in options.spec_of(a).stacks] for a in (saved, current)]
    assert placements == [["pre", "pre"], ["pre", "pre"]]
    assert config_check.config_differences(saved, current) == []
    _, peri = build_model("preln_iwslt_de_en", *DIMS, "--norm-placement", "peri")
    assert [d[0] for d in config_check.config_differences(saved, peri)] == ["norm_placement"]


def test_a_stored_unknown_placement_stops_with_one_line():
    _, args = build_model("deepinit_tiny")
    args.norm_placement = "sandwich"
    with pytest.raises(DeepInitConfigError, match=r"unknown --norm-placement 'sandwich'; choose from auto, post"):
        options.resolve_and_validate(args)


def test_checkpoint_round_trip():
    a, _ = build_model("periln_iwslt_de_en", *DIMS, seed=1)
    b, _ = build_model("periln_iwslt_de_en", *DIMS, seed=2)
    b.load_state_dict(a.state_dict(), strict=True)
    a.eval(), b.eval()
    assert torch.equal(a(**tiny_batch())[0], b(**tiny_batch())[0])


# --- end to end --------------------------------------------------------------------------------------


def _train(data, *cli):
    return run_cli(
        "train", data, "--user-dir", USER_DIR, *TINY_DIMS, "--optimizer", "adam", "--lr", "1e-3",
        "--max-tokens", "500", "--max-update", "2", "--cpu", "--num-workers", "0", "--log-format", "simple",
        "--log-interval", "1", "--seed", "1", "--disable-validation", *cli, check=False,
    )  # fmt: skip


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_translation_trains_generates_and_refuses_a_changed_placement_on_resume(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    mt = ["--task", "translation", "-s", "src", "-t", "tgt", "--save-dir", save, "--no-epoch-checkpoints"]
    proc = _train(synthetic_bin, *mt, "--arch", "periln_iwslt_de_en", "--layernorm-embedding")
    log = proc.stdout
    assert proc.returncode == 0 and "encoder=peri-norm, decoder=peri-norm" in log, log[-3000:]
    assert re.search(r"num_updates 2\b", log), log[-2000:]
    gen = run_cli(
        "generate", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--path", save / "checkpoint_last.pt", "--beam", "2", "--max-len-b", "5", "--batch-size", "8",
        "--required-batch-size-multiple", "1", "--cpu", "--num-workers", "0", "--gen-subset", "valid", forked=True,
    ).stdout  # fmt: skip
    assert re.search(r"^H-\d+\t", gen, re.M) and "BLEU" in gen, gen[-2000:]
    changed = _train(synthetic_bin, *mt, "--arch", "periln_iwslt_de_en", "--layernorm-embedding",
                     "--norm-placement", "reordered", "--max-update", "3")  # fmt: skip
    assert changed.returncode == 1 and "norm_placement" in changed.stdout, changed.stdout[-2000:]


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_language_model_trains_and_reloads(lm_bin, tmp_path):
    """The reordered LM end to end (the translation test above runs peri; the golden fixture and the
    op-count test build both placements for both models)."""
    save = tmp_path / "ckpt"
    proc = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                   "reordered_lm_tiny", *LM_TRAIN, "--max-update", "2", "--save-dir", save,
                   "--disable-validation", check=False)  # fmt: skip
    assert proc.returncode == 0 and "decoder=reordered-norm" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"num_updates 2\b", proc.stdout), proc.stdout[-2000:]
    ev = run_cli("eval_lm", lm_bin, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
                 "--tokens-per-sample", "32", "--cpu", "--num-workers", "0", forked=True).stdout  # fmt: skip
    assert re.search(r"Perplexity: [0-9.]+", ev), ev[-2000:]


# --- kernels per training update against stock fairseq -----------------------------------------------


def _update_ops(kind: str, arch: str, *flags: str):
    from deepinit_tools.bench.readiness_build import update_ops
    from deepinit_tools.harness.fairseq_train import Shape

    return update_ops(kind, arch, Shape(2, 16, 32, 2), *flags)[0]


@pytest.mark.parametrize("kind", ["mt", "lm"])
def test_op_count_against_stock_pre_ln(kind):
    """``reordered`` moves each norm and adds none: at most 1.02x stock Pre-LN's kernels per update;
    ``peri`` adds one norm per sub-layer (2 per encoder layer, 3 per decoder layer with cross-attention,
    2 per decoder-only layer), each a forward and a backward norm kernel plus its parameters' optimizer
    kernels (the figures: docs/schemes.md)."""

    from deepinit_tools.bench import gpu_readiness as gr

    gr.plugin()
    suffix = "_iwslt_de_en" if kind == "mt" else "_lm_tiny"
    stock = _update_ops(kind, gr.stock_arch(kind), *(["--encoder-normalize-before", "--decoder-normalize-before"]
                                                      if kind == "mt" else []))  # fmt: skip
    reordered = _update_ops(kind, "reordered" + suffix)
    peri = _update_ops(kind, "periln" + suffix)
    assert reordered.total <= 1.02 * stock.total, (reordered.total, stock.total)
    extra = 2 * (2 + 3) if kind == "mt" else 2 * 2
    for op in ("aten.native_layer_norm.default", "aten.native_layer_norm_backward.default"):
        assert peri.counts[op] - reordered.counts[op] == extra, (op, peri.counts[op], reordered.counts[op])
