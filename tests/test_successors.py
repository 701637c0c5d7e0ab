"""The successor methods of issue #16, each against its authors' released code (re-implemented here
from the cited file and line, not imported): closed-form Admin (admin-torch), Sub-LN (torchscale),
torchscale's DeepNorm constants, B2T connection (takase/b2t_connection), NormFormer on both stacks
(fairseq's own decoder layer); plus their bad-input rules and a short fairseq-train of each new arch."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from test_schemes import assert_uniform

from conftest import USER_DIR, build_model, run_cli
from fairseq_deepinit.admin import admin_residuals
from fairseq_deepinit.admin.export import export_args, fold_state_dict, verify
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.residual import ConstantResidual

N_E, N_D = 2, 3  # different depths: an encoder/decoder mix-up in a formula shows


def dims(d: int = 32, ffn: int = 64, heads: int = 2, layers=(N_E, N_D)) -> list:
    return [
        "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
        "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
        "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
        "--encoder-layers", str(layers[0]), "--decoder-layers", str(layers[1]), "--dropout", "0",
    ]  # fmt: skip


def ln(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return F.layer_norm(x, (x.size(-1),), norm.weight, norm.bias, 1e-5)


def mha(q_in, kv_in, attn, causal: bool = False, inner_ln: nn.Module | None = None) -> torch.Tensor:
    """Multi-head attention written out (torchscale component/multihead_attention.py:130-169)."""
    t, b, d = q_in.shape
    h = attn.num_heads
    q = F.linear(q_in, attn.q_proj.weight, attn.q_proj.bias) * (d // h) ** -0.5
    k = F.linear(kv_in, attn.k_proj.weight, attn.k_proj.bias)
    v = F.linear(kv_in, attn.v_proj.weight, attn.v_proj.bias)
    split = lambda x: x.reshape(x.size(0), b * h, d // h).transpose(0, 1)  # noqa: E731
    scores = torch.bmm(split(q), split(k).transpose(1, 2))
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.bmm(scores.softmax(-1), split(v)).transpose(0, 1).reshape(t, b, d)
    if inner_ln is not None:
        out = ln(out, inner_ln)  # multihead_attention.py:166-167
    return F.linear(out, attn.out_proj.weight, attn.out_proj.bias)


# --- closed-form Admin (admin-torch) ----------------------------------------------------------------


def admin_torch_calculate_init(num_res_layers: int, output_change_scale: str) -> float:
    """microsoft/admin-torch @ 08b6605, admin_torch/admin.py:73-81 (calculate_init)."""
    if output_change_scale in ("O(logn)", "default"):
        omega_value = (num_res_layers + 1) / math.log(num_res_layers + 1) - 1
    elif output_change_scale == "O(n)":
        omega_value = 1.0
    else:
        omega_value = num_res_layers
    return omega_value**0.5


@pytest.mark.parametrize("scale", ["O(logn)", "O(n)", "O(1)"])
@pytest.mark.parametrize("layers", [(1, 1), (2, 3), (6, 6), (18, 18), (100, 100)])
def test_closed_form_admin_omega_matches_admin_torch(scale, layers):
    model, args = build_model(
        "admin_closed_iwslt_de_en", *dims(layers=layers), "--admin-output-change", scale, seed=layers[0]
    )
    assert args.admin_formula == "closed-form" and args.admin_output_change == scale
    want = {
        "encoder": admin_torch_calculate_init(2 * layers[0], scale),
        "decoder": admin_torch_calculate_init(3 * layers[1], scale),
    }
    res = admin_residuals(model)
    assert len(res) == 2 * layers[0] + 3 * layers[1]
    for name, m in res.items():
        assert bool(m.profiled), name
        torch.testing.assert_close(
            m.omega.detach(), torch.full_like(m.omega, want[name.split(".")[0]]), rtol=1e-7, atol=0
        )
    if scale == "O(logn)" and layers == (6, 6):  # a hand value: sqrt(13/ln 13 - 1), sqrt(19/ln 19 - 1)
        assert abs(want["encoder"] - 2.0170092) < 1e-6 and abs(want["decoder"] - 2.3351322) < 1e-6


def test_closed_form_admin_exports_to_plain_postln_with_the_same_logits():
    model, args = build_model("admin_closed_iwslt_de_en", *dims())
    with torch.no_grad():  # a trained omega is not constant: make it vary per dimension
        for m in admin_residuals(model).values():
            m.omega.mul_(torch.empty_like(m.omega).uniform_(0.5, 1.5))
    sd = model.state_dict()
    plain_sd, changes = fold_state_dict(sd, args)
    diff = verify(sd, args, plain_sd, export_args(args, changes), tolerance=1e-5)
    assert diff <= 1e-5


# --- Sub-LN (torchscale) -----------------------------------------------------------------------------


def torchscale_subln_gain(stack: str, n: int, m: int) -> float:
    """torchscale @ 4d1e0e8: architecture/encoder.py:255-260, decoder.py:301-302 (encoder-decoder)."""
    if stack == "encoder":
        return math.sqrt(math.log(3 * m) * math.log(2 * n) / 3)
    return math.sqrt(math.log(m * 3))


def test_subln_layer_order_matches_torchscale():
    model, _ = build_model("subln_iwslt_de_en", *dims())
    model.eval()
    with torch.no_grad():  # non-trivial norm parameters, so a skipped or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    x = torch.randn(5, 2, 32)
    enc = model.encoder.layers[0]
    dec = model.decoder.layers[0]
    enc_out = torch.randn(4, 2, 32)
    with torch.no_grad():
        # torchscale architecture/encoder.py:124-161 with feedforward_network.py:131-142
        r = x + mha(
            ln(x, enc.self_attn_layer_norm),
            ln(x, enc.self_attn_layer_norm),
            enc.self_attn,
            inner_ln=enc.self_attn.out_proj.norm,
        )
        h = F.relu(enc.fc1(ln(r, enc.final_layer_norm)))
        want = r + F.linear(ln(h, enc.fc2.norm), enc.fc2.weight, enc.fc2.bias)
        torch.testing.assert_close(enc(x, None), want, rtol=1e-5, atol=1e-5)
        # decoder.py:145-206: causal self-attention with the inner norm, cross-attention without
        y = ln(x, dec.self_attn_layer_norm)
        r = x + mha(y, y, dec.self_attn, causal=True, inner_ln=dec.self_attn.out_proj.norm)
        r = r + mha(ln(r, dec.encoder_attn_layer_norm), enc_out, dec.encoder_attn)
        h = F.relu(dec.fc1(ln(r, dec.final_layer_norm)))
        want = r + F.linear(ln(h, dec.fc2.norm), dec.fc2.weight, dec.fc2.bias)
        future = torch.full((5, 5), float("-inf")).triu(1)
        got, _, _ = dec(x, enc_out, None, self_attn_mask=future)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not hasattr(dec.encoder_attn.out_proj, "norm")  # multihead_attention.py:51: self-attention only


def test_subln_init_gain_matches_torchscale():
    sub, _ = build_model("subln_iwslt_de_en", *dims(), seed=3)
    base, _ = build_model("deepinit_tiny", *dims(), "--init-scheme", "fairseq", "--encoder-normalize-before",
                          "--decoder-normalize-before", seed=3)  # fmt: skip
    subs, bases = dict(sub.named_parameters()), dict(base.named_parameters())
    scaled = ("fc1", "fc2", "self_attn.out_proj", "self_attn.v_proj")  # encoder.py:263-270, decoder.py:305-314
    for name, p in subs.items():
        if ".layers." not in name or ".norm." in name:
            continue
        stack = name.split(".")[0]
        gain = torchscale_subln_gain(stack, N_E, N_D) if any(f".{s}." in name for s in scaled) else 1.0
        torch.testing.assert_close(p.detach(), bases[name].detach() * gain, rtol=1e-6, atol=0, msg=name)
    assert torchscale_subln_gain("encoder", N_E, N_D) != 1.0


# --- torchscale DeepNorm -----------------------------------------------------------------------------


def test_deepnorm_torchscale_constants_per_parameter():
    d, ffn, n, m = 256, 512, 2, 3
    model, args = build_model("deepnorm_torchscale_iwslt_de_en", *dims(d, ffn, 4, (n, m)), seed=5)
    paper, _ = build_model("deepnorm_iwslt_de_en", *dims(d, ffn, 4, (n, m)), seed=5)
    assert args.deepnorm_variant == "torchscale"
    # torchscale @ 4d1e0e8 architecture/encoder.py:237-242, decoder.py:288
    scale = {"encoder": (n**4 * m) ** 0.0625 / 1.15, "decoder": math.pow(12.0 * m, 0.25)}
    for name, p in model.named_parameters():
        if ".layers." not in name or "layer_norm" in name or ".residuals." in name:
            continue
        stack = name.split(".")[0]
        fan_in = p.size(1) if p.dim() == 2 else dict(model.named_parameters())[name[: -len("bias")] + "weight"].size(1)
        divided = any(s in name for s in ("fc1", "fc2", "out_proj", "v_proj"))  # encoder.py:246-251
        bound = fan_in**-0.5 / (scale[stack] if divided else 1.0)  # nn.Linear's default init, then div_
        if p.dim() == 2:
            assert_uniform(p, bound, name)
        else:
            assert p.abs().max().item() <= bound * (1 + 1e-6), name
    # the residual alpha is the paper's (encoder.py:78-85, decoder.py:89-91)
    alphas = {k: m_.alpha for k, m_ in model.named_modules() if isinstance(m_, ConstantResidual)}
    assert alphas["encoder.layers.0.residuals.ffn"] == pytest.approx(0.81 * (n**4 * m) ** 0.0625)
    assert alphas["decoder.layers.0.residuals.ffn"] == pytest.approx((3.0 * m) ** 0.25)
    # the paper's variant is unchanged: xavier_normal with beta on v_proj
    v = paper.encoder.layers[0].self_attn.v_proj.weight
    assert abs(v.std().item() / (0.87 * (n**4 * m) ** (-1 / 16) * math.sqrt(2 / (2 * d))) - 1) < 0.02


# --- B2T connection ----------------------------------------------------------------------------------


def test_b2t_layer_matches_released_formula():
    model, _ = build_model("b2t_iwslt_de_en", *dims())
    model.eval()
    enc, dec = model.encoder.layers[1], model.decoder.layers[2]
    x, enc_out = torch.randn(5, 2, 32), torch.randn(4, 2, 32)
    with torch.no_grad():
        # takase/b2t_connection @ c8e2ad4 fairseq/modules/transformer_layer.py:103-144
        h = enc.self_attn_layer_norm(x + mha(x, x, enc.self_attn))
        y = h + enc.fc2(F.relu(enc.fc1(h)))
        want = enc.final_layer_norm(x + y)
        torch.testing.assert_close(enc(x, None), want, rtol=1e-5, atol=1e-5)
        # transformer_layer.py:277-375 (decoder): the bottom is the input of the self-attention
        h = dec.self_attn_layer_norm(x + mha(x, x, dec.self_attn, causal=True))
        g = dec.encoder_attn_layer_norm(h + mha(h, enc_out, dec.encoder_attn))
        want = dec.final_layer_norm(x + (g + dec.fc2(F.relu(dec.fc1(g)))))
        got, _, _ = dec(x, enc_out, None, self_attn_mask=torch.full((5, 5), float("-inf")).triu(1))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_b2t_rescales_every_layer_weight_as_released():
    b2t, _ = build_model("b2t_iwslt_de_en", *dims(), seed=4)
    base, _ = build_model("deepinit_tiny", *dims(), "--init-scheme", "fairseq", seed=4)
    bases = dict(base.named_parameters())
    for name, p in b2t.named_parameters():
        layers = N_E if name.startswith("encoder") else N_D
        # transformer_layer.py:401-405: non-LayerNorm weights times layer_num^-0.5
        factor = layers**-0.5 if ".layers." in name and "weight" in name and "layer_norm" not in name else 1.0
        torch.testing.assert_close(p.detach(), bases[name].detach() * factor, rtol=1e-6, atol=0, msg=name)


# --- NormFormer --------------------------------------------------------------------------------------

NORMFORMER = ("--scale-attn", "--scale-fc", "--scale-heads", "--scale-resids")


def _normformer_model():
    model, args = build_model("normformer_iwslt_de_en", *dims(), "--scale-resids")
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("attn_ln", "ffn_layernorm", "c_attn", "w_resid")):
                p.uniform_(0.5, 1.5)
    return model, args


def test_normformer_decoder_is_fairseqs_own_layer():
    model, args = _normformer_model()
    ours = model.decoder.layers[1]
    cfg = TransformerConfig.from_namespace(args)
    ref = TransformerDecoderLayerBase(cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)  # same parameter names: fairseq builds them
    ref.eval()
    x, enc_out = torch.randn(5, 2, 32), torch.randn(4, 2, 32)
    future = torch.full((5, 5), float("-inf")).triu(1)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(x, enc_out, None, self_attn_mask=future)[0], ref(x, enc_out, None, self_attn_mask=future)[0]
        )


def test_normformer_encoder_applies_the_decoders_operations():
    model, args = _normformer_model()
    ours = model.encoder.layers[0]
    names = {n for n, _ in ours.named_parameters()}
    assert {"attn_ln.weight", "c_attn", "ffn_layernorm.weight", "w_resid"} <= names
    ref = TransformerEncoderLayerBase(TransformerConfig.from_namespace(args))  # no NormFormer in fairseq's encoder
    ref.load_state_dict({k: v for k, v in ours.state_dict().items() if k in ref.state_dict()}, strict=True)
    ref.eval()
    x = torch.randn(5, 2, 32)
    with torch.no_grad():
        # fairseq/modules/transformer_layer.py:458-466 and 505-514, on the encoder
        a, _ = ref.self_attn(query=ln(x, ours.self_attn_layer_norm), key=ln(x, ours.self_attn_layer_norm),
                             value=ln(x, ours.self_attn_layer_norm), key_padding_mask=None)  # fmt: skip
        a = (a.view(5, 2, 2, 16) * ours.c_attn.view(1, 1, 2, 1)).reshape(5, 2, 32)
        r = x + ln(a, ours.attn_ln)
        h = F.relu(ref.fc1(ln(r, ours.final_layer_norm)))
        want = ours.w_resid * r + ref.fc2(ln(h, ours.ffn_layernorm))
        torch.testing.assert_close(ours(x, None), want, rtol=1e-5, atol=1e-5)


# --- bad inputs --------------------------------------------------------------------------------------

BAD = [
    ("subln_iwslt_de_en", ["--norm-type", "none"], "--norm-type none"),
    ("subln_iwslt_de_en", ["--init-scheme", "t-fixup"], "--init-scheme t-fixup"),
    ("deepinit_tiny", ["--subln"], "--encoder-normalize-before"),
    ("subln_iwslt_de_en", ["--scale-fc"], "drop --scale-fc"),
    ("b2t_iwslt_de_en", ["--encoder-normalize-before"], "Post-LN only"),
    ("b2t_iwslt_de_en", ["--norm-type", "none"], "--norm-type none"),
    ("deepinit_tiny", ["--b2t-init-rescale", "none"], "--residual-scale b2t"),
    ("admin_closed_iwslt_de_en", ["--admin-profile-batches", "2"], "never profiles"),
    ("admin_iwslt_de_en", ["--admin-output-change", "O(1)"], "--admin-formula closed-form"),
    ("deepinit_tiny", ["--deepnorm-variant", "torchscale"], "--init-scheme deepnorm"),
    ("deepinit_tiny", ["--scale-attn"], "Pre-LN"),
    ("normformer_iwslt_de_en", ["--norm-type", "none"], "--norm-type none"),
    ("normformer_iwslt_de_en", ["--residual-scale", "rezero"], "--residual-scale rezero"),
]


@pytest.mark.parametrize("arch,cli,says", BAD, ids=[f"{a}{''.join(c)}" for a, c, _ in BAD])
def test_bad_combinations_stop_with_one_line(arch, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(arch, *dims(), *cli)
    assert says in str(e.value) and "\n" not in str(e.value)


# --- end to end --------------------------------------------------------------------------------------

ARCHS = ["subln", "b2t", "normformer", "admin_closed", "deepnorm_torchscale"]


@pytest.mark.parametrize("family", ARCHS)
def test_fairseq_train_runs(family, synthetic_bin, tmp_path):
    log = run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", f"{family}_iwslt_de_en", *dims(), "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500",
        "--max-update", "3", "--cpu", "--num-workers", "0", "--no-save", "--log-format", "simple",
        "--log-interval", "1", "--seed", "1", "--disable-validation",
    ).stdout  # fmt: skip
    assert "deepinit: init=" in log and "done training" in log, log[-2000:]
    assert re.search(r"num_updates 3\b", log), log[-2000:]
