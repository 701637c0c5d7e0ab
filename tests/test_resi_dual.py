"""ResiDual (``--residual-scale resi-dual``; fairseq_deepinit/methods/resi_dual.py, modules/dual_stream.py)
against the independent port of microsoft/ResiDual @ 8682f75 (``tests/ports/resi_dual.py``).

With identical weights (read out of the plugin's modules by ``ports.common``): one encoder layer and one
decoder layer (both streams, eval and train mode with the dropout mask shared by the two streams), the
whole encoder, the whole decoder and the decoder-only LM (the final combination ``alpha x + LN_1e-7(raw)``,
the raw stream started from the embedding output), fp64 and fp32; step-by-step decoding against the full
forward; the refusals; fairseq-train for translation and LM, checkpoint reload and fairseq-generate; the
aten operators it adds to the Post-LN forward, counted against the formula.

Tolerances (:func:`tol`): the port runs in fp64 on the plugin's (exactly representable) weights and inputs.
A sub-layer's output is a chain of inner products of length at most ``n = max(d, d_ff, T)``, each off by
``gamma_n = n u / (1 - n u)`` relative to the sum of its terms' magnitudes; the Post-LN after it divides by
the branch's standard deviation, which at these inits is O(1) (gain within 10 % of 1), so every sub-layer
adds at most ``gamma_n`` times the magnitude of its operands, and the errors of ``S`` sub-layers add.
``tol = 4 S gamma_n max|ref|`` (the factor 4 for the softmax, the LN's mean and variance and the final
sum); fp32: ~1e-4 here, fp64: ~1e-13. A wrong formula (the raw stream started at zero, one sub-layer's
branch not added, the final eps 1e-5, alpha ignored, two dropout masks) is off by 1e-3 to O(1) in fp64;
each was checked to fail here.
"""

from __future__ import annotations

import re

import pytest
import torch
from ports import resi_dual as port
from ports.common import AttnWeights, FFNWeights, NormSpec
from test_lm import build_lm

from conftest import TINY_DIMS, USER_DIR, build_model, padded_tokens, run_cli, train_tiny_lm
from deepinit_tools import fairseq_argv as fa
from deepinit_tools.harness.op_counters import OpCounter
from fairseq_deepinit.errors import DeepInitConfigError

D, FF, H, L = 16, 32, 2, 2
DIMS = fa.dims(L, D, FF, H)
LM_DIMS = fa.dims(L, D, FF, H, stacks=("decoder",))
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")
PAD = 1


def tol(dtype: torch.dtype, sublayers: int, n: int, ref: torch.Tensor, softmax32: bool) -> float:
    """``4 S (gamma_n + 2 u_sm) max|ref|`` (module docstring); ``u_sm`` fp32's when the attention takes
    fairseq's explicit path, whose softmax runs in fp32 whatever the dtype (``fairseq/utils.py:514-518``)."""
    u = torch.finfo(dtype).eps / 2
    u_sm = torch.finfo(torch.float32).eps / 2 if softmax32 else u
    return 4 * sublayers * (n * u / (1 - n * u) + 2 * u_sm) * max(1.0, ref.abs().max().item())


def close(got: torch.Tensor, ref: torch.Tensor, sublayers: int, softmax32: bool = False) -> None:
    t = tol(got.dtype, sublayers, max(D, FF), ref, softmax32)
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= t, (err, t)


def perturb_norms(model: torch.nn.Module, seed: int = 5) -> None:
    """Gains 1 +- 0.1, biases +- 0.1: a norm read with the wrong parameter would show."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(getattr(m, "normalized_shape", None), tuple):
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))


def mt(*cli: str, dtype=torch.float64, eval_: bool = True):
    model, args = build_model("resi_dual_iwslt_de_en", *DIMS, *NO_DROPOUT, *cli)
    perturb_norms(model)
    model.to(dtype).train(not eval_)
    return model, args


def lm(*cli: str, dtype=torch.float64):
    model, args, _ = build_lm("resi_dual_lm_tiny", *LM_DIMS, *NO_DROPOUT, *cli)
    perturb_norms(model)
    return model.to(dtype).eval(), args


def enc_params(layer) -> dict:
    return dict(
        attn_w=AttnWeights.from_module(layer.self_attn),
        ffn_w=FFNWeights.from_module(layer),
        ln_attn=NormSpec.from_module(layer.self_attn_layer_norm),
        ln_ffn=NormSpec.from_module(layer.final_layer_norm),
    )


def dec_params(layer) -> dict:
    cross = layer.encoder_attn is not None
    return dict(
        self_w=AttnWeights.from_module(layer.self_attn),
        cross_w=AttnWeights.from_module(layer.encoder_attn) if cross else None,
        ffn_w=FFNWeights.from_module(layer),
        ln_self=NormSpec.from_module(layer.self_attn_layer_norm),
        ln_cross=NormSpec.from_module(layer.encoder_attn_layer_norm) if cross else None,
        ln_ffn=NormSpec.from_module(layer.final_layer_norm),
    )


def final_ln(stack) -> NormSpec:
    """The released final norm: the stack's parameters with the released eps (``resi_dual.py:24, 157``)."""
    return port.final_layer_norm(stack.layer_norm.weight.detach(), stack.layer_norm.bias.detach())


# ---- structure ------------------------------------------------------------------------------------------


def test_structure_is_the_released_one():
    model, _ = build_model("resi_dual_iwslt_de_en", *DIMS)
    for stack in (model.encoder, model.decoder):
        assert isinstance(stack.layer_norm, torch.nn.LayerNorm) and stack.layer_norm.eps == port.FINAL_LN_EPS
        assert stack.dual_stream is not None and all(layer.placement == "post" for layer in stack.layers)
        assert stack.embed_positions is not None and stack.layernorm_embedding is None
    keys = set(model.state_dict())
    # the release's parameter names: fairseq's, with the final norm in fairseq's layer_norm slot
    assert {"encoder.layer_norm.weight", "decoder.layer_norm.bias", "encoder.layers.1.final_layer_norm.weight"} <= keys
    assert not any("raw" in k or "dual" in k for k in keys)


# ---- one layer, both streams ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("scale", [1.0, port.OPUS_RES_SCALE])
def test_encoder_layer_equals_port(dtype, scale):
    model, _ = mt("--resi-dual-scale", str(scale), dtype=dtype)
    layer = model.encoder.layers[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, D, generator=g, dtype=torch.float64).to(dtype)  # B x T x C
    raw = torch.randn(3, 5, D, generator=g, dtype=torch.float64).to(dtype) * 3
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, :2] = True
    with torch.no_grad():
        gx, graw, fc = layer(x.transpose(0, 1), mask, raw=raw.transpose(0, 1))
    wx, wraw = port.encoder_layer(x.double(), raw.double(), **_d(enc_params(layer)), n_heads=H, scale=scale,
                                  key_padding_mask=mask)  # fmt: skip
    assert fc is None
    close(gx.transpose(0, 1), wx, 2)
    close(graw.transpose(0, 1), wraw, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("scale", [1.0, port.OPUS_RES_SCALE])
def test_decoder_layer_equals_port(dtype, scale):
    model, _ = mt("--resi-dual-scale", str(scale), dtype=dtype)
    layer = model.decoder.layers[0]
    g = torch.Generator().manual_seed(1)
    x, raw, enc = (torch.randn(3, n, D, generator=g, dtype=torch.float64).to(dtype) for n in (4, 4, 6))
    enc_mask = torch.zeros(3, 6, dtype=torch.bool)
    enc_mask[1, :3] = True
    causal = torch.triu(torch.full((4, 4), float("-inf"), dtype=dtype), 1)
    with torch.no_grad():
        gx, _, _, graw = layer(x.transpose(0, 1), enc.transpose(0, 1), enc_mask, None, self_attn_mask=causal,
                               raw=raw.transpose(0, 1))  # fmt: skip
    wx, wraw = port.decoder_layer(x.double(), raw.double(), enc.double(), **_d(dec_params(layer)), n_heads=H,
                                  scale=scale, encoder_padding_mask=enc_mask)  # fmt: skip
    close(gx.transpose(0, 1), wx, 3, softmax32=True)
    close(graw.transpose(0, 1), wraw, 3, softmax32=True)


def _d(params: dict) -> dict:
    """Port parameters in fp64 (the plugin's values, exactly)."""

    def to64(v):
        if isinstance(v, torch.Tensor):
            return v.double()
        if hasattr(v, "__dataclass_fields__"):
            return type(v)(**{k: to64(getattr(v, k)) for k in v.__dataclass_fields__})
        return v

    return {k: to64(v) for k, v in params.items()}


def test_one_dropout_mask_feeds_both_streams():
    """Train mode (``resi_dual_layers.py:35-39, 49-51``): the branch output is dropped out once and that same
    tensor goes into both streams; the port draws its masks from the same generator state in fairseq's
    time-first memory order."""
    model, _ = build_model("resi_dual_iwslt_de_en", *DIMS, "--dropout", "0.5", "--attention-dropout", "0",
                           "--activation-dropout", "0")  # fmt: skip
    model.double().train()
    layer = model.encoder.layers[0]
    g = torch.Generator().manual_seed(2)
    x, raw = (torch.randn(3, 5, D, generator=g, dtype=torch.float64) for _ in range(2))

    def drop(t):  # B x T x C: the mask fairseq's dropout would draw for the T x B x C tensor
        return torch.nn.functional.dropout(t.transpose(0, 1).contiguous(), 0.5, training=True).transpose(0, 1)

    torch.manual_seed(7)
    gx, graw, _ = layer(x.transpose(0, 1), None, raw=raw.transpose(0, 1))
    torch.manual_seed(7)
    wx, wraw = port.encoder_layer(x, raw, **enc_params(layer), n_heads=H, dropout=drop)
    close(gx.transpose(0, 1).detach(), wx, 2)
    close(graw.transpose(0, 1).detach(), wraw, 2)
    assert not torch.equal(wraw, port.encoder_layer(x, raw, **enc_params(layer), n_heads=H)[1])  # dropout was on


# ---- whole stacks: the raw stream from the embedding, the final combination --------------------------------

STACK_CASES = [
    pytest.param(("--resi-dual-scale", "1"), id="s1"),
    pytest.param(("--resi-dual-scale", str(port.OPUS_RES_SCALE), "--resi-dual-alpha", "0.5"), id="s0.05-alpha0.5"),
    pytest.param(("--layernorm-embedding",), id="layernorm-embedding"),
    pytest.param(("--attention-impl", "sdpa"), id="sdpa"),
]


def _stack_options(args) -> dict:
    return dict(scale=args.resi_dual_scale, alpha=args.resi_dual_alpha)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cli", STACK_CASES)
def test_translation_model_equals_port(cli, dtype):
    model, args = mt(*cli, dtype=dtype)
    src, prev = padded_tokens(3, 7, 3, pad_first_row=2), padded_tokens(3, 5, 4)
    mask = src.eq(PAD)
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=src.ne(PAD).sum(1))
        feats, extra = model.decoder(prev, encoder_out=enc, features_only=True)
        x0 = model.encoder.forward_embedding(src)[0] * (1 - mask.unsqueeze(-1).to(dtype))
        y0 = extra["inner_states"][0].transpose(0, 1)
    e_layers = [_d(enc_params(layer)) for layer in model.encoder.layers]
    want_enc = port.encoder(x0.double(), e_layers, _d({"n": final_ln(model.encoder)})["n"], H,
                            key_padding_mask=mask, **_stack_options(args))  # fmt: skip
    close(enc["encoder_out"][0].transpose(0, 1), want_enc, 2 * L + 1)
    d_layers = [_d(dec_params(layer)) for layer in model.decoder.layers]
    enc_in = enc["encoder_out"][0].transpose(0, 1).double()  # the plugin's encoder output: each stack on its own
    want = port.decoder(y0.double(), enc_in, d_layers, _d({"n": final_ln(model.decoder)})["n"], H,
                        encoder_padding_mask=mask, **_stack_options(args))  # fmt: skip
    close(feats, want, 3 * L + 1 + 2 * L + 1, softmax32=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_language_model_equals_port(dtype):
    model, args = lm("--resi-dual-scale", str(port.OPUS_RES_SCALE), dtype=dtype)
    toks = padded_tokens(2, 6, 5)
    with torch.no_grad():
        feats, extra = model.decoder(toks, features_only=True)
    y0 = extra["inner_states"][0].transpose(0, 1)
    layers = [_d(dec_params(layer)) for layer in model.decoder.layers]
    assert all(p["cross_w"] is None for p in layers)
    want = port.decoder(y0.double(), None, layers, _d({"n": final_ln(model.decoder)})["n"], H, **_stack_options(args))
    close(feats, want, 2 * L + 1, softmax32=True)


def test_zero_start_is_the_commented_alternative():
    """``--resi-dual-start zero``: ``res = torch.zeros_like(x)`` (the comment at ``resi_dual.py:107``)."""
    model, args = mt("--resi-dual-start", "zero")
    src = padded_tokens(2, 6, 8)
    with torch.no_grad():
        got = model.encoder(src, src_lengths=torch.full((2,), 6))["encoder_out"][0].transpose(0, 1)
        x = model.encoder.forward_embedding(src)[0]
    res = torch.zeros_like(x)
    for layer in model.encoder.layers:
        x, res = port.encoder_layer(x, res, **enc_params(layer), n_heads=H)
    close(got, port.stack_output(x, res, final_ln(model.encoder)), 2 * L + 1)


# ---- incremental decoding -------------------------------------------------------------------------------


def test_incremental_decoding_matches_the_full_forward():
    """The raw stream is per position (no attention reads it): a step needs nothing of it cached."""
    model, _ = mt("--resi-dual-scale", "0.05", dtype=torch.float64)
    src, prev = padded_tokens(2, 6, 9), padded_tokens(2, 5, 10)
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=torch.full((2,), 6))
        full = model.decoder(prev, encoder_out=enc)[0]
        state: dict = {}
        steps = [model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0] for t in range(5)]
    close(torch.cat(steps, 1), full, 3 * L + 1, softmax32=True)
    model, _ = lm(dtype=torch.float64)
    toks = padded_tokens(2, 6, 11)
    with torch.no_grad():
        full = model(toks)[0]
        state = {}
        steps = [model.decoder(toks[:, : t + 1], incremental_state=state)[0] for t in range(6)]
    close(torch.cat(steps, 1), full, 2 * L + 1, softmax32=True)


# ---- refusals -------------------------------------------------------------------------------------------

BAD = [
    (("--encoder-normalize-before",), "defined for Post-LN only"),
    (("--decoder-normalize-before",), "defined for Post-LN only"),
    (("--init-scheme", "t-fixup"), "needs a norm with norm(s x) = norm(x)"),
    (("--norm-type", "none"), "needs a norm with norm(s x) = norm(x)"),
    (("--init-scheme", "deepnorm"), "needs --residual-scale deepnorm"),
    (("--init-scheme", "admin"), "needs --residual-scale admin"),
    (("--scale-resids",), "--scale-resids is defined on Pre-LN"),
    (("--scale-attn",), "defined on Pre-LN"),
    (("--decoder-layer-type", "matt"), "drop --decoder-layer-type matt"),
    (("--resi-dual-scale", "0"), "--resi-dual-scale must be a finite number greater than 0"),
    (("--resi-dual-alpha", "inf"), "--resi-dual-alpha must be a finite number"),
    (("--resi-dual-final-eps", "-1"), "--resi-dual-final-eps must be"),
]


@pytest.mark.parametrize("cli,says", BAD, ids=[" ".join(c) for c, _ in BAD])
def test_bad_combinations_stop_with_one_line(cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model("resi_dual_iwslt_de_en", *DIMS, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_options_belong_to_resi_dual():
    with pytest.raises(DeepInitConfigError) as e:
        build_model("postln_iwslt_de_en", *DIMS, "--resi-dual-scale", "0.05")
    assert "--resi-dual-scale" in str(e.value) and "\n" not in str(e.value)


def test_fp16_with_an_unscaled_stream_warns(caplog):
    """``--fp16`` with ``s = 1`` warns and names the released 0.05 (``opus.yaml:25-26``); ``s = 0.05`` does not."""
    with caplog.at_level("WARNING", logger="fairseq_deepinit.methods.resi_dual"):
        build_model("resi_dual_iwslt_de_en", *DIMS, "--fp16")
    assert "--resi-dual-scale 0.05" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fairseq_deepinit.methods.resi_dual"):
        build_model("resi_dual_iwslt_de_en", *DIMS, "--fp16", "--resi-dual-scale", "0.05")
    assert "resi-dual" not in caplog.text


def test_composes_with_post_ln_inits_and_norms():
    for cli in (("--init-scheme", "ds-init"), ("--init-scheme", "lipschitz"), ("--norm-type", "rmsnorm")):
        model, _ = build_model("resi_dual_iwslt_de_en", *DIMS, *cli)
        assert model.decoder.layer_norm.eps == port.FINAL_LN_EPS and model.decoder.dual_stream is not None


# ---- operators: one norm and one add per stack, one add per sub-layer -------------------------------------


def _forward_ops(arch: str, *cli: str) -> int:
    model, _ = build_model(arch, *DIMS, *NO_DROPOUT, *cli)
    model.eval()
    src, prev = padded_tokens(2, 6, 12), padded_tokens(2, 5, 13)
    with torch.no_grad(), OpCounter() as ops:
        model(src, torch.full((2,), 6), prev)
    return ops.total


def _norm_ops() -> int:
    norm, x = torch.nn.LayerNorm(D, eps=1e-7), torch.zeros(5, 2, D)
    with torch.no_grad(), OpCounter() as ops:
        norm(x)
    return ops.total


def test_forward_adds_a_norm_and_an_add_per_stack_and_an_add_per_sublayer():
    """Against the plugin's Post-LN with the same (fairseq) init: 2 stacks x (final norm + final add) and one
    add per sub-layer (2 per encoder layer, 3 per decoder layer); ``s != 1`` adds a multiply to each term."""
    postln = _forward_ops("postln_iwslt_de_en", "--init-scheme", "fairseq")
    sublayers = 2 * L + 3 * L
    assert _forward_ops("resi_dual_iwslt_de_en") - postln == 2 * (_norm_ops() + 1) + sublayers
    scaled = _forward_ops("resi_dual_iwslt_de_en", "--resi-dual-scale", "0.05", "--resi-dual-alpha", "0.5")
    assert scaled - postln == 2 * (_norm_ops() + 1) + 2 * sublayers + 2 * 2  # + s x0 and alpha x per stack


# ---- end to end ------------------------------------------------------------------------------------------


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_reload_and_generate(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    log = run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", "resi_dual_iwslt_de_en", *TINY_DIMS, "--resi-dual-scale", "0.05", "--optimizer", "adam",
        "--lr", "1e-3", "--max-tokens", "500", "--max-update", "3", "--cpu", "--num-workers", "0",
        "--save-dir", save, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
        "--seed", "1", "--disable-validation", forked=True,
    ).stdout  # fmt: skip
    assert "residual=resi-dual" in log and "resi-dual-scale=0.05" in log, log[-2000:]
    assert re.search(r"num_updates 3\b", log) and "done training" in log, log[-2000:]

    from fairseq import checkpoint_utils

    import fairseq_deepinit  # noqa: F401

    models, cfg, _task = checkpoint_utils.load_model_ensemble_and_task([str(save / "checkpoint_last.pt")])
    model = models[0].eval()
    assert cfg.model.resi_dual_scale == 0.05 and model.encoder.dual_stream.scale == 0.05
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k in state)
    assert state["decoder.layer_norm.weight"].shape == (64,)

    gen = run_cli(
        "generate", synthetic_bin, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt", "--task",
        "translation", "-s", "src", "-t", "tgt", "--gen-subset", "test", "--beam", "2", "--batch-size", "64",
        "--required-batch-size-multiple", "1", "--max-len-b", "20", "--cpu", "--num-workers", "0", forked=True,
    ).stdout  # fmt: skip
    assert len(re.findall(r"^H-\d+\t", gen, flags=re.M)) == 100, gen[-2000:]


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_language_model(lm_bin, tmp_path):
    out = train_tiny_lm(lm_bin, tmp_path, "resi_dual_lm_tiny")
    assert "residual=resi-dual" in out and "done training" in out and re.search(r"num_updates 3\b", out), out[-2000:]
