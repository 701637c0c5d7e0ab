"""``--norm-type dyt`` / ``--norm-type derf`` wired into the models (``methods/dyt.py``, ``methods/derf.py``):
every norm of a translation model and a language model becomes DyT / Derf with its position's alpha,
the model's output equals the independent port of the released code (``tests/ports/dyt.py`` for the norms,
``tests/ports/norm_placement.py`` and ``ports.common`` for the layers) with identical weights, the bad
combinations stop with one line, and fairseq-train / generate / resume run.

Tolerance of the port comparisons (fp64 throughout, sdpa attention so that the softmax is fp64 too): the
plugin and the port compute the same sums in other orders, so they differ by the rounding of each: an
output feature goes through about ``L (4 d + d_ff) + V`` multiply-adds (projections, FFN, output layer)
plus the norms' and softmax's few roundings per element, each at most ``u = 2^-53`` relative to the sum of
magnitudes, and the tiny models' layers amplify it by O(1) (tanh and erf have slope <= 1.13 times alpha);
``64 * (L (4 d + d_ff) + V) * u`` relative to the largest magnitude (about 4e-12 here) is a safe bound.
A wrong alpha, bias, shift, position or embedding scale changes the output by more than 1e-3.
"""

from __future__ import annotations

import re

import pytest
import torch
from ports import common, norm_placement
from ports import dyt as port
from test_kernels import DIMS, RECIPE_DROPOUT, padded_batch, train_step
from test_lm import N_SYMBOLS, TRAIN, build_lm

from conftest import TINY_DIMS, USER_DIR, build_model, run_cli, tiny_batch
from deepinit_tools.harness.op_counters import OpCounter
from fairseq_deepinit.checkpoints.config_check import config_differences
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.dyt import RELEASED_ALPHA_INIT, Derf, DyT

F64 = torch.float64
PRE = ["--encoder-normalize-before", "--decoder-normalize-before"]
POINTWISE = (DyT, Derf)


def norm_slots(model) -> dict:
    """``{name: class name}`` of every norm module (stock LayerNorm, the plugin's norms, DyT, Derf)."""
    names = ("LayerNorm", "FusedLayerNorm", "ScaleNorm", "RMSNorm", "DyT", "Derf")
    return {n: type(m).__name__ for n, m in model.named_modules() if type(m).__name__ in names}


# --- every norm replaced --------------------------------------------------------------------------

CONFIGS = {
    "pre+embedding-norm": ("deepinit_tiny", [*PRE, "--layernorm-embedding"]),
    "post": ("deepinit_tiny", []),
    "normformer": ("normformer_iwslt_de_en", TINY_DIMS),
    "subln": ("subln_iwslt_de_en", TINY_DIMS),
    "matt": ("matt_iwslt_de_en", TINY_DIMS),
}


@pytest.mark.parametrize("norm", ["dyt", "derf"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_norm_becomes_the_pointwise_norm(config, norm):
    """The slots that hold a LayerNorm in the same model with ``--norm-type layernorm`` hold DyT / Derf,
    and there is no other norm module."""
    arch, cli = CONFIGS[config]
    stock, _ = build_model(arch, *cli, "--norm-type", "layernorm")
    model, args = build_model(arch, *cli, "--norm-type", norm)
    expected = {name: "DyT" if norm == "dyt" else "Derf" for name in norm_slots(stock)}
    assert len(expected) >= 6 and norm_slots(model) == expected
    assert args.norm_eps is None


def test_lm_norms_and_learnable_embed_scale():
    model, args, _ = build_lm("dyt_lm_tiny")
    stock, _, _ = build_lm("preln_lm_tiny")
    assert norm_slots(model) == {name: "DyT" for name in norm_slots(stock)} and "decoder.layer_norm" in norm_slots(
        model
    )
    assert args.dyt_embed_scale == "learnable"
    scale = model.decoder.embed_scale
    assert isinstance(scale, torch.nn.Parameter) and scale.item() == 8.0 and "decoder.embed_scale" in model.state_dict()
    translation, targs = build_model("dyt_iwslt_de_en", *TINY_DIMS)
    assert targs.dyt_embed_scale == "fixed" and translation.encoder.embed_scale == 8.0


def test_alpha_by_position():
    """attn: the norms before self- and cross-attention; ffn: before the FFN and every norm without a
    released position (embedding norm, NormFormer's inner norms); final: the stacks' last norms."""
    model, _ = build_model(
        "normformer_iwslt_de_en", *TINY_DIMS, "--norm-type", "dyt", "--dyt-alpha-init", "0.8,0.2,0.3",
        "--layernorm-embedding",
    )  # fmt: skip
    alphas = {n: m.alpha.item() for n, m in model.named_modules() if isinstance(m, DyT)}
    for name, alpha in alphas.items():
        if name.endswith(("self_attn_layer_norm", "encoder_attn_layer_norm")):
            want = 0.8
        elif name.endswith(("encoder.layer_norm", "decoder.layer_norm")):
            want = 0.3
        else:
            assert name.endswith(("final_layer_norm", "layernorm_embedding", "attn_ln", "ffn_layernorm")), name
            want = 0.2
        assert alpha == pytest.approx(want, rel=1e-7), name
    model, _, _ = build_lm("derf_lm_tiny", "--derf-alpha-init", "llama2_13b", "--derf-shift-init", "-0.25")
    got = {
        n: (m.alpha.item(), m.shift.item(), m.bias is not None) for n, m in model.named_modules() if isinstance(m, Derf)
    }
    table = RELEASED_ALPHA_INIT["llama2_13b"]
    assert got["decoder.layers.1.self_attn_layer_norm"] == (pytest.approx(table.attn), -0.25, True)
    assert got["decoder.layers.1.final_layer_norm"] == (pytest.approx(table.ffn), -0.25, True)
    assert got["decoder.layer_norm"] == (pytest.approx(table.final), -0.25, True)


# --- output against the port ------------------------------------------------------------------------


@torch.no_grad()
def perturb(model, seed: int = 0) -> None:
    """Every norm scalar and channel parameter (and the embedding scale) away from its init, so that a
    parameter read from the wrong place shows."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, POINTWISE):
            for name, p in m.named_parameters():
                step = 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                p.add_(step.abs() if name == "alpha" else step)  # alpha stays > 0
    for stack in (getattr(model, "encoder", None), model.decoder):
        if stack is not None and isinstance(stack.embed_scale, torch.nn.Parameter):
            stack.embed_scale.mul_(0.7)


def port_norm(m):
    """The released formula of the plugin module ``m`` (DyT with or without bias, Derf), weights read out."""
    p = {n: v.detach() for n, v in m.named_parameters()}
    if isinstance(m, Derf):
        return lambda x: port.derf(x, p["alpha"], p["shift"], p["weight"], p.get("bias"))
    if m.bias is None:
        return lambda x: port.dyt_llama(x, p["alpha"], p["weight"])
    return lambda x: port.dyt(x, p["alpha"], p["weight"], p["bias"])


def embedding(stack, tokens):
    """fairseq's ``embed_scale * tok + positions`` (``transformer_encoder.py:125-129``), scale the LLaMA code's
    ``shared(x_in) * shared_scale`` (``llama.py:383``) when learnable."""
    tok = stack.embed_tokens(tokens)
    scaled = port.embed_llama(tok, stack.embed_scale)
    pos = stack.embed_positions(tokens)
    norm = None if stack.layernorm_embedding is None else port_norm(stack.layernorm_embedding)
    return norm_placement.embed(scaled, pos, None, norm, source="fairseq")


def port_layer_norms(layer, placement: str, cross: bool) -> dict:
    side = "in" if placement == "pre" else "out"
    norms = {f"attn.{side}": port_norm(layer.self_attn_layer_norm), f"ffn.{side}": port_norm(layer.final_layer_norm)}
    if cross:
        norms[f"cross.{side}"] = port_norm(layer.encoder_attn_layer_norm)
    return norms


def bound(model, scale: torch.Tensor, cross: bool = False) -> float:
    """The fp64 bound of the module docstring; ``cross``: plus fairseq's cross-attention softmax, which runs in
    fp32 whatever the input (``fairseq/utils.py:518``; SDPA serves self-attention only): each probability
    rounded a few times (exp, sum, divide, cast: <= 4 u32 relative), so each cross-attention output errs by
    <= 4 u32 max|v|, amplified O(1) by the layers after it (64 per decoder layer is ample)."""
    d, f = model.decoder.embed_dim, model.decoder.layers[0].fc1.out_features
    n_layers = len(model.decoder.layers) + (len(model.encoder.layers) if hasattr(model, "encoder") else 0)
    ops = n_layers * (4 * d + f) + N_SYMBOLS + 8
    softmax32 = 64 * len(model.decoder.layers) * 2.0**-24 if cross else 0.0
    return (64 * ops * 2.0**-53 + softmax32) * scale.abs().max().item()


def test_translation_equals_the_port():
    """Post-LN Derf with shift and per-channel parameters perturbed (the wav2vec 2.0 Base placement):
    the decoder's output features equal the port's encoder and decoder with the same weights."""
    model, args = build_model(
        "deepinit_tiny", "--norm-type", "derf", "--derf-shift-init", "0.1", "--dropout", "0", "--attention-impl",
        "sdpa", "--layernorm-embedding", "--derf-embed-scale", "learnable",
    )  # fmt: skip
    model = model.double().eval()
    perturb(model)
    batch = tiny_batch()
    heads = args.encoder_attention_heads
    x = embedding(model.encoder, batch["src_tokens"])
    for layer in model.encoder.layers:
        w = common.AttnWeights.from_module(layer.self_attn), common.FFNWeights.from_module(layer)
        x = norm_placement.encoder_layer(x, *w, port_layer_norms(layer, "post", False), "post", heads)
    y = embedding(model.decoder, batch["prev_output_tokens"])
    for layer in model.decoder.layers:
        w = (common.AttnWeights.from_module(layer.self_attn), common.AttnWeights.from_module(layer.encoder_attn),
             common.FFNWeights.from_module(layer))  # fmt: skip
        y = norm_placement.decoder_layer(y, x, *w, port_layer_norms(layer, "post", True), "post", heads)
    got, _ = model(**batch, features_only=True)
    torch.testing.assert_close(got, y, rtol=0, atol=bound(model, y, cross=True))


def test_lm_equals_the_port():
    """Pre-LN DyT language model, LLaMA variant (per-position alpha of the 7B release, no bias, learnable
    embedding scale): logits equal the port's stack, final norm and tied output layer."""
    model, args, _ = build_lm("dyt_lm_tiny", "--dyt-alpha-init", "llama2_7b", "--no-dyt-bias", "--dropout", "0",
                              "--attention-impl", "sdpa", "--share-decoder-input-output-embed")  # fmt: skip
    assert all(m.bias is None for m in model.modules() if isinstance(m, DyT))  # the LLaMA variant
    model = model.double().eval()
    perturb(model, seed=1)
    tokens = torch.randint(4, 4 + N_SYMBOLS, (3, 9), generator=torch.Generator().manual_seed(0))
    dec = model.decoder
    y = embedding(dec, tokens)
    for layer in dec.layers:
        w = common.AttnWeights.from_module(layer.self_attn), None, common.FFNWeights.from_module(layer)
        y = norm_placement.decoder_layer(
            y, None, *w, port_layer_norms(layer, "pre", False), "pre", args.decoder_attention_heads
        )
    y = port_norm(dec.layer_norm)(y)
    logits = common.linear(y, dec.embed_tokens.weight.detach())
    got, _ = model(tokens)
    torch.testing.assert_close(got, logits, rtol=0, atol=bound(model, logits))


def test_state_dict_round_trip():
    """A trained-looking state (perturbed norms, learnable embedding scale) loads strictly into a fresh
    model of the same options and gives the same output."""
    cli = ("dyt_lm_tiny", "--no-dyt-bias", "--dropout", "0")
    model, _, _ = build_lm(*cli)
    perturb(model)
    fresh, _, _ = build_lm(*cli, seed=7)
    fresh.load_state_dict(model.state_dict(), strict=True)
    tokens = torch.randint(4, 4 + N_SYMBOLS, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fresh.eval()(tokens)[0], model.eval()(tokens)[0], rtol=0, atol=0)


# --- refusals ---------------------------------------------------------------------------------------

BAD = [
    ("deepinit_tiny", ["--norm-type", "dyt", "--norm-eps", "1e-6"], "--norm-eps does not apply to --norm-type dyt"),
    ("deepinit_tiny", ["--dyt-alpha-init", "0.5"], "--dyt-alpha-init only applies to --norm-type dyt, not layernorm"),
    ("deepinit_tiny", ["--norm-type", "dyt", "--derf-shift-init", "0.1"], "only applies to --norm-type derf, not dyt"),
    ("deepinit_tiny", ["--norm-type", "derf", "--dyt-embed-scale", "learnable"], "only applies to --norm-type dyt"),
    ("deepinit_tiny", ["--norm-type", "dyt", "--dyt-alpha-init", "0"], "give one number > 0"),
    ("deepinit_tiny", ["--norm-type", "dyt", "--dyt-alpha-init", "0.5,0.2"], "attn,ffn,final"),
    ("deepinit_tiny", ["--norm-type", "dyt", "--dyt-alpha-init", "llama7b"], "llama2_7b"),
    ("deepinit_tiny", ["--norm-type", "derf", "--derf-alpha-init", "nan"], "give one number > 0"),
    ("deepinit_tiny", ["--norm-type", "derf", "--derf-shift-init", "inf"], "--derf-shift-init must be a finite"),
    ("deepinit_tiny", ["--norm-type", "dyt", "--dyt-alpha-init", "llama2_7b"], "Post-LN stack"),
    ("deepinit_tiny", ["--init-scheme", "t-fixup", "--norm-type", "dyt"], "t-fixup needs --norm-type none"),
]  # fmt: skip


@pytest.mark.parametrize("arch,cli,says", BAD, ids=[" ".join(c) for _, c, _ in BAD])
def test_bad_combinations_stop_with_one_line(arch, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(arch, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


# --- end to end ---------------------------------------------------------------------------------------


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_translation_trains_generates_and_reloads(synthetic_bin, tmp_path):
    """fairseq-train (Pre-LN DyT, 3 updates, checkpoint saved), then fairseq-generate from the checkpoint."""
    common_args = [synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt"]
    out = run_cli(
        "train", *common_args, "--arch", "dyt_iwslt_de_en", *TINY_DIMS, "--dyt-alpha-init", "0.6,0.3,0.3",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--max-update", "3", "--cpu", "--num-workers",
        "0", "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--disable-validation",
        "--save-dir", tmp_path, "--no-epoch-checkpoints", forked=True,
    ).stdout  # fmt: skip
    assert "norm=dyt" in out and "dyt alpha-init=0.6,0.3,0.3" in out and re.search(r"num_updates 3\b", out), out[-2000:]
    gen = run_cli(
        "generate", *common_args, "--path", tmp_path / "checkpoint_last.pt", "--beam", "2", "--max-tokens", "500",
        "--cpu", "--num-workers", "0", "--required-batch-size-multiple", "1", "--max-len-b", "5", forked=True,
    ).stdout  # fmt: skip
    assert re.search(r"^H-\d+\t", gen, re.M) and "Generate test" in gen, gen[-2000:]


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_lm_trains_resumes_and_reloads(lm_bin, tmp_path):
    """fairseq-train of the Derf LM (learnable embedding scale), resumed from its checkpoint; the stored
    options are the resolved ones and the resume check compares the new ones (in process)."""
    cli = [lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "derf_lm_tiny", *TRAIN]
    cli += ["--save-dir", tmp_path, "--disable-validation", "--derf-alpha-init", "0.8,0.2,0.2"]
    out = run_cli("train", *cli, "--max-update", "3", forked=True).stdout
    assert "norm=derf" in out and "embed-scale=learnable" in out and re.search(r"num_updates 3\b", out), out[-2000:]
    out = run_cli("train", *cli, "--max-update", "5", forked=True).stdout
    assert "Loaded checkpoint" in out and re.search(r"num_updates 5\b", out), out[-2000:]
    ckpt = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
    assert ckpt["model"]["decoder.embed_scale"].item() != 8.0  # the scalar trained
    saved = ckpt["cfg"]["model"]
    assert (saved.derf_alpha_init, saved.derf_embed_scale, saved.norm_eps) == ("0.8,0.2,0.2", "learnable", None)
    _, same, _ = build_lm("derf_lm_tiny", "--decoder-layers", "3", "--derf-alpha-init", "0.8,0.2,0.2")
    _, other, _ = build_lm("derf_lm_tiny", "--decoder-layers", "3", "--derf-embed-scale", "fixed")
    assert config_differences(saved, same) == []
    assert {name for name, _, _ in config_differences(saved, other)} == {"derf_alpha_init", "derf_embed_scale"}


# --- kernels per training step against LayerNorm's model ------------------------------------------

# aten operators of one forward + backward of the block beyond LayerNorm's 2 (tests/test_dyt.py: 10, 9, 14)
EXTRA_PER_NORM = {("dyt", True): 8, ("dyt", False): 7, ("derf", True): 12}


@pytest.mark.parametrize("norm,bias", sorted(EXTRA_PER_NORM))
def test_step_ops_against_layernorm(norm, bias):
    """A Pre-LN training step (forward, loss, backward) launches exactly the block's extra operators per norm
    over the same model with LayerNorm, plus one per norm whose input is fairseq's transposed (T, B, C)
    view (alpha's gradient as mul + sum instead of one dot): no copy anywhere (the input gradient comes
    back contiguous, as LayerNorm's, so no view's backward upstream copies it)."""

    def step(arch, *flags):
        model, _ = build_model(arch, *DIMS, *RECIPE_DROPOUT, *flags)
        with OpCounter() as ops:
            train_step(model, padded_batch())
        return ops, sum(isinstance(m, POINTWISE) for m in model.modules())

    ref, _ = step("preln_iwslt_de_en")
    ops, n = step(f"{norm}_iwslt_de_en", *([] if bias else [f"--no-{norm}-bias"]))
    extra = ops.total - ref.total
    assert n == 12 and EXTRA_PER_NORM[norm, bias] * n <= extra <= (EXTRA_PER_NORM[norm, bias] + 1) * n, (extra, n)
    assert ops.counts.get("aten.clone.default", 0) == ref.counts.get("aten.clone.default", 0), ops.counts
