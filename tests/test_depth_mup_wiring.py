"""Depth-muP / CompleteP wired into the models and fairseq's trainer (``fairseq_deepinit/methods/depth_mup.py``,
``modules/residual.py: BranchScaleResidual``, ``training/depth_mup_trainer.py: install``), against the independent port
(``tests/ports/depth_mup.py``: nanoGPT-mup ``completep`` model.py:113,117-118; CompleteP Table 1; Megatron-LM
PR 4999). The constants and the optimizer classes themselves: tests/test_depth_mup.py.

- every sub-layer's multiplier is the port's ``(L_stack / L_base)^-alpha``; the models' outputs with identical
  weights equal a Pre-LN model composed from the port's ``residual_add`` (translation: encoder, decoder with
  cross-attention; decoder-only LM), float64 and float32, alpha 1/2 and 1;
- the fused add against the two-kernel form and its layout;
- the optimizer fairseq's ``Trainer`` builds: each group's lr and eps as the port computes them at 6 and 48
  layers (base 6), for the three sources;
- refusals (one line), fairseq-train for translation (saved, resumed: the groups survive) and an LM;
- aten ops of a training update within 2 % of stock fairseq's Pre-LN.

Tolerances (as tests/test_lnscale.py derives them). float64: fairseq's explicit attention path computes its
softmax in float32 (``fairseq/utils.py:518``), which the following O(1)-conditioned steps carry to < 1e-6.
float32 against the float64 port on the same weights: each reduction of length n is off by at most ``n u``
(u = 2^-24); per layer the norms (d), projections (d), scores (d/H), weighted sum (T), FFN (d + d_ff) and the
fused add (2u): ``TOL32 = 4 L sum(n) u``, about 1e-4. A wrong multiplier (alpha 1/2 for 1, the other stack's
L, no multiplier on cross-attention) moves the outputs by 1e-2 or more.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from ports import depth_mup as port
from ports.common import AttnWeights, FFNWeights, NormSpec, attention, ffn

from conftest import USER_DIR, build_model, make_dictionary, run_cli, tiny_batch
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.residual import BranchScaleResidual, residual_modules

D, FF, H = 16, 32, 2
ENC, DEC, BASE = 3, 4, 2  # m_L 1.5 (encoder) and 2 (decoder): each stack's own multiplier shows
U32 = 2.0**-24
TOL32 = 4 * max(ENC, DEC) * (3 * D + D // H + 7 + D + D + FF + 2) * U32
ALPHAS = [0.5, 1.0]


def dims(enc: int = ENC, dec: int = DEC) -> list:
    return [
        "--encoder-embed-dim", str(D), "--decoder-embed-dim", str(D),
        "--encoder-ffn-embed-dim", str(FF), "--decoder-ffn-embed-dim", str(FF),
        "--encoder-attention-heads", str(H), "--decoder-attention-heads", str(H),
        "--encoder-layers", str(enc), "--decoder-layers", str(dec), "--dropout", "0",
    ]  # fmt: skip


def family(alpha: float) -> str:
    return "completep" if alpha == 1.0 else "depth_mup"


def translation(alpha: float, *cli: str):
    return build_model(f"{family(alpha)}_iwslt_de_en", *dims(), "--depth-mup-base-layers", str(BASE), *cli)


def build_lm(arch: str, *cli: str):
    from fairseq import options, tasks

    import fairseq_deepinit  # noqa: F401

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["/nonexistent", "--task", "language_modeling", "--arch", arch, *cli])
    d = make_dictionary(50)
    task = tasks.TASK_REGISTRY["language_modeling"](args, d, d)
    torch.manual_seed(1)
    return task.build_model(args), args, task


@torch.no_grad()
def perturb_norms(model: torch.nn.Module, seed: int = 5) -> None:
    """Norm gains and biases away from 1 and 0, so that a norm applied in the wrong place shows."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g).to(p.dtype))


def port_encoder_layer(x, layer, m):
    n = NormSpec.from_module
    h = n(layer.self_attn_layer_norm)(x)
    x = port.residual_add(x, attention(h, h, AttnWeights.from_module(layer.self_attn), H), *m)
    return port.residual_add(x, ffn(n(layer.final_layer_norm)(x), FFNWeights.from_module(layer)), *m)


def port_decoder_layer(y, memory, layer, m):
    n = NormSpec.from_module
    h = n(layer.self_attn_layer_norm)(y)
    y = port.residual_add(y, attention(h, h, AttnWeights.from_module(layer.self_attn), H, causal=True), *m)
    if memory is not None:
        h = n(layer.encoder_attn_layer_norm)(y)
        y = port.residual_add(y, attention(h, memory, AttnWeights.from_module(layer.encoder_attn), H), *m)
    return port.residual_add(y, ffn(n(layer.final_layer_norm)(y), FFNWeights.from_module(layer)), *m)


def decoder_embedding(decoder, tokens):
    return decoder.embed_scale * decoder.embed_tokens(tokens) + decoder.embed_positions(tokens)


# --------------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize("alpha", ALPHAS)
def test_every_sublayer_takes_its_stacks_multiplier(alpha):
    model, args = translation(alpha)
    assert (args.depth_mup, args.depth_mup_alpha, args.residual_scale) == (True, alpha, "depth-mup")
    want = {"encoder": port.branch_multiplier(ENC, BASE, alpha), "decoder": port.branch_multiplier(DEC, BASE, alpha)}
    residuals = residual_modules(model)
    assert len(residuals) == 2 * ENC + 3 * DEC
    for name, module in residuals.items():
        assert type(module) is BranchScaleResidual
        assert module.multiplier == pytest.approx(want[name.split(".")[0]], rel=1e-15), name
    lm, _, _ = build_lm(f"{family(alpha)}_lm_tiny_48l")
    multipliers = [m.multiplier for m in residual_modules(lm).values()]
    assert len(multipliers) == 2 * 48 and multipliers == pytest.approx([port.branch_multiplier(48, 6, alpha)] * 96)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_at_the_base_depth_the_model_is_pre_lns(alpha):
    """(L / L_base)^-alpha = 1 at L = L_base: the Pre-LN family's weights and output, bit for bit (so the
    Multi30k matrix runs depth-muP at 18 layers, not at its base depth 6: docs/results.md)."""
    model, _ = build_model(f"{family(alpha)}_iwslt_de_en", *dims(BASE, BASE), "--depth-mup-base-layers", str(BASE))
    pre_ln, _ = build_model("preln_iwslt_de_en", *dims(BASE, BASE))
    mine, theirs = model.state_dict(), pre_ln.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    batch = tiny_batch()
    assert torch.equal(model.eval()(**batch)[0], pre_ln.eval()(**batch)[0])


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_translation_model_equals_the_port(alpha, dtype):
    model, _ = translation(alpha)
    model = model.to(dtype).eval()
    perturb_norms(model)
    batch = tiny_batch()
    with torch.no_grad():
        enc = model.encoder(batch["src_tokens"], src_lengths=batch["src_lengths"])
        feats, _ = model.decoder(batch["prev_output_tokens"], encoder_out=enc, features_only=True)
        got = (enc["encoder_out"][0].transpose(0, 1), feats)
        model = model.double()
        n = NormSpec.from_module
        x = model.encoder.forward_embedding(batch["src_tokens"])[0]
        for layer in model.encoder.layers:
            x = port_encoder_layer(x, layer, (ENC, BASE, alpha))
        memory = n(model.encoder.layer_norm)(x)
        y = decoder_embedding(model.decoder, batch["prev_output_tokens"])
        for layer in model.decoder.layers:
            y = port_decoder_layer(y, memory, layer, (DEC, BASE, alpha))
        want = (memory, n(model.decoder.layer_norm)(y))
    tol = 1e-6 if dtype == torch.float64 else TOL32
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_language_model_equals_the_port(alpha, dtype):
    layers = 4
    model, _, _ = build_lm(f"{family(alpha)}_lm_tiny", "--decoder-layers", str(layers), "--decoder-embed-dim",
                           str(D), "--decoder-ffn-embed-dim", str(FF), "--decoder-attention-heads", str(H),
                           "--dropout", "0", "--depth-mup-base-layers", "1")  # fmt: skip
    model = model.to(dtype).eval()
    perturb_norms(model)
    tokens = torch.randint(4, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.decoder(tokens, features_only=True)[0]
        dec = model.double().decoder
        y = decoder_embedding(dec, tokens)
        for layer in dec.layers:
            y = port_decoder_layer(y, None, layer, (layers, 1, alpha))
        want = NormSpec.from_module(dec.layer_norm)(y)
    tol = 1e-12 if dtype == torch.float64 else TOL32
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fused_add_is_the_two_kernel_form_up_to_one_rounding(dtype):
    """``torch.add(residual, x, alpha=m)`` vs ``residual + m * x`` (``ports.depth_mup.residual_add``): at most
    ``2u (|m x| + |out|)`` apart per element (one rounding of the product, one of the sum); the output is
    contiguous when the skip is fairseq's transposed (T, B, C) view of the embedding."""
    g = torch.Generator().manual_seed(0)
    u = torch.finfo(dtype).eps / 2
    m = port.branch_multiplier(48, 6, 0.5)
    residual = torch.randn(3, 7, 16, generator=g, dtype=dtype).transpose(0, 1)  # (T, B, C) view
    x = torch.randn(7, 3, 16, generator=g, dtype=dtype)
    got = BranchScaleResidual(m)(x, residual)
    want = port.residual_add(residual, x, 48, 6, 0.5)
    assert got.is_contiguous()
    bound = 2 * u * ((m * x).abs() + want.abs())
    assert ((got - want).abs() <= bound).all()
    assert not torch.allclose(got, residual + x)  # the multiplier is applied


# ------------------------------------------------------------------------------- fairseq's trainer and groups


def lm_trainer(arch: str, *cli: str):
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    model, args, task = build_lm(arch, "--optimizer", "adam_foreach", "--lr", "1e-3", "--adam-eps", "1e-8", "--cpu",
                                 "--lr-scheduler", "fixed", *cli)  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    return Trainer(cfg, task, model, task.build_criterion(cfg.criterion)), model, args


@pytest.mark.parametrize("alpha, source", [(1.0, "paper"), (0.5, "paper"), (0.5, "nanogpt"), (1.0, "megatron")])
def test_trainer_groups_at_6_and_48_layers_are_the_ports(alpha, source):
    """The learning rate and eps of every param group of the optimizer fairseq's Trainer builds, for a model
    tuned at 6 layers (base 6) and the same flags at 48: base values times the port's multipliers."""
    from fairseq_deepinit.training.param_groups import innermost

    for layers in (6, 48):
        trainer, model, args = lm_trainer(f"{family(alpha)}_lm_tiny", "--decoder-layers", str(layers),
                                          "--depth-mup-source", source)  # fmt: skip
        trainer.lr_step(0)
        inner = innermost(trainer.optimizer)
        want = port.group_scales(layers, 6, alpha, source)
        names = {id(p): n for n, p in model.named_parameters()}
        seen = set()
        for group in inner.param_groups:
            kind = group["group"].rpartition(".")[2]
            assert group["lr"] == pytest.approx(1e-3 * want[kind]["lr"], rel=1e-14), (layers, group["group"])
            assert group["eps"] == pytest.approx(1e-8 * want[kind]["eps"], rel=1e-14), (layers, group["group"])
            seen |= {names[id(p)] for p in group["params"]}
        assert seen == {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainer.get_lr() == 1e-3
        if layers == 48 and (alpha, source) == (0.5, "paper"):
            assert sorted({g["lr"] for g in inner.param_groups}) == pytest.approx([1e-3 * 8**-0.5, 1e-3])


def test_trainer_refuses_fairseqs_adam_in_one_line():
    with pytest.raises(DeepInitConfigError) as e:
        lm_trainer("completep_lm_tiny", "--optimizer", "adam")[0].optimizer  # noqa: B018
    assert "builds one parameter group" in str(e.value) and "use --optimizer adam_foreach" in str(e.value)
    assert "\n" not in str(e.value)


# -------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "cli, says",
    [
        (("deepinit_tiny", "--depth-mup"), "defined on Pre-LN"),
        (("completep_iwslt_de_en", "--norm-placement", "peri"), "--norm-placement peri"),
        (("completep_iwslt_de_en", "--residual-scale", "b2t"), "--residual-scale b2t"),
        (("completep_iwslt_de_en", "--init-scheme", "ds-init"), "--init-scheme ds-init"),
        (("completep_iwslt_de_en", "--init-scheme", "normal-scaled"), "--init-scheme normal-scaled"),
        (("completep_iwslt_de_en", "--init-scheme", "t-fixup"), "--init-scheme t-fixup"),
        (("completep_iwslt_de_en", "--layernorm-scaling"), "--layernorm-scaling"),
        (("completep_iwslt_de_en", "--mix-ln"), "--mix-ln"),
        (("completep_iwslt_de_en", "--scale-resids"), "--scale-resids"),
        (("completep_iwslt_de_en", "--norm-type", "none"), "--norm-type none"),
        (("depth_mup_iwslt_de_en", "--depth-mup-source", "megatron"), "fixes alpha = 1"),
        (("completep_iwslt_de_en", "--depth-mup-alpha", "0.25"), "[0.5, 1]"),
        (("completep_iwslt_de_en", "--depth-mup-base-layers", "0"), "at least one layer"),
        (("preln_iwslt_de_en", "--depth-mup-alpha", "0.5"), "needs --depth-mup"),
        (("preln_iwslt_de_en", "--residual-scale", "depth-mup"), "use --depth-mup"),
    ],
)
def test_refusals_are_one_line(cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(cli[0], *dims(2, 2), *cli[1:])
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------------------------- speed


@pytest.mark.parametrize("kind", ["mt", "lm"])
def test_update_ops_within_2_percent_of_stock(kind):
    """One training update of the 4-layer CompleteP family against stock fairseq Pre-LN (the same optimizer,
    fairseq's adam, on both): the multiplier rides on the residual add, at most 1.02x stock's aten ops."""
    from deepinit_tools.bench import gpu_readiness as gr
    from deepinit_tools.bench.readiness_build import update_ops
    from deepinit_tools.harness.fairseq_train import Shape

    gr.plugin()
    shape = Shape(4, 16, 32, 2)
    plugin, b = update_ops(kind, gr.Family(kind, "completep").arch, shape)
    assert {type(m) for m in residual_modules(b.model).values()} == {BranchScaleResidual}
    stock, _ = update_ops(kind, gr.stock_arch(kind), shape, *gr.stock_flags(b))
    assert plugin.total <= 1.02 * stock.total, (plugin.total, stock.total, plugin.total / stock.total)


# ----------------------------------------------------------------------------------------- fairseq-train

TRAIN = ["--optimizer", "adam_foreach", "--lr", "1e-3", "--cpu", "--num-workers", "0", "--log-format", "simple",
         "--log-interval", "1", "--seed", "1"]  # fmt: skip


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_translation_saves_and_resumes_the_groups(synthetic_bin, tmp_path):
    def train(updates: int) -> str:
        return run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t",
                       "tgt", "--arch", "completep_iwslt_de_en", *dims(), "--max-tokens", "500", *TRAIN,
                       "--max-update", str(updates), "--save-dir", tmp_path, "--no-epoch-checkpoints",
                       "--disable-validation", forked=True).stdout  # fmt: skip

    log = train(2)
    assert "depth-mup alpha=1 base-layers=6" in log and "depth-muP optimizer groups" in log, log[-2000:]
    assert re.search(r"num_updates 2\b", log), log[-2000:]
    ckpt = tmp_path / "checkpoint_last.pt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["last_optimizer_state"]["param_groups"]
    want = port.group_scales(DEC, 6, 1.0)  # the decoder's ratio 4/6 (and the encoder's 3/6)
    by_name = {g["group"]: g for g in saved}
    assert by_name["decoder.hidden_weight"]["eps"] == pytest.approx(1e-8 * want["hidden_weight"]["eps"], rel=1e-14)
    assert by_name["encoder.hidden_norm"]["eps"] == pytest.approx(1e-8 * 2.0, rel=1e-14)  # (3/6)^-1
    assert by_name["embedding"]["eps"] == 1e-8
    log = train(3)  # resumes checkpoint_last.pt: groups, rates and Adam's state
    assert re.search(r"[Ll]oaded checkpoint .*\(epoch 1 @ 2 updates\)", log) and re.search(r"num_updates 3\b", log), (
        log[-2000:]
    )
    assert "resuming with this run's optimizer group multipliers" not in log  # the saved multipliers are the run's
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["last_optimizer_state"]
    assert [(g["group"], g["eps"], g["lr_scale"]) for g in state["param_groups"]] == [
        (g["group"], g["eps"], g["lr_scale"]) for g in saved
    ]
    assert {s["step"] for s in state["state"].values()} == {3}  # Adam's state continued, not restarted
    from fairseq import checkpoint_utils  # fairseq's loader (generate, interactive): the stored options resolve again

    (model,), _ = checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"data": str(synthetic_bin)})
    saved_model = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved_model.items())
    assert [m.multiplier for m in residual_modules(model).values()] == pytest.approx(
        [port.branch_multiplier(ENC, 6, 1.0)] * (2 * ENC) + [port.branch_multiplier(DEC, 6, 1.0)] * (3 * DEC)
    )


@pytest.mark.slow
@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_language_model(tmp_path):
    root = tmp_path / "raw"
    root.mkdir()
    for split, n in (("train", 60), ("valid", 10)):
        (root / f"{split}.txt").write_text("\n".join(" ".join(f"w{(i * j) % 20}" for j in range(8)) for i in range(n)))
    run_cli("preprocess", "--only-source", "--trainpref", root / "train.txt", "--validpref", root / "valid.txt",
            "--destdir", tmp_path / "bin", "--workers", "1", forked=True)  # fmt: skip
    log = run_cli("train", tmp_path / "bin", "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                  "depth_mup_lm_tiny", "--decoder-layers", "12", "--tokens-per-sample", "16", "--max-tokens", "128",
                  *TRAIN, "--max-update", "2", "--no-save", "--disable-validation", forked=True).stdout  # fmt: skip
    assert "depth-mup alpha=0.5 base-layers=6" in log and re.search(r"num_updates 2\b", log), log[-2000:]
    assert "decoder.hidden_weight" in log and f"lr x{2**-0.5:.4g}" in log, log[-2000:]
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", log)]
    assert losses and all(math.isfinite(x) for x in losses), log[-2000:]


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_refuses_fairseqs_adam_in_one_line(synthetic_bin, tmp_path):
    proc = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                   "--arch", "completep_iwslt_de_en", *dims(2, 2), "--max-tokens", "500", *TRAIN, "--optimizer",
                   "adam", "--max-update", "1", "--no-save", "--disable-validation", check=False)  # fmt: skip
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-2000:]
    assert "use --optimizer adam_foreach" in errors[0] and "Traceback" not in proc.stdout
