"""The successor methods, each against its authors' released code (re-implemented here
from the cited file and line, not imported): closed-form Admin (admin-torch), Sub-LN (torchscale),
torchscale's DeepNorm constants, B2T connection (takase/b2t_connection), NormFormer on both stacks
(fairseq's own decoder layer); the first three also decoder-only (the layer's stack kind), and
NormFormer under deepcopy, state-dict round trips and fairseq's EMA; plus their bad-input rules (each arch's
fairseq-train, resume and generate: tests/test_cli.py's pipelines)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from test_schemes import assert_uniform

from conftest import USER_DIR, build_model, run_cli, tiny_batch
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
        gain = released_subln(stack, True, N_E, N_D) if any(f".{s}." in name for s in scaled) else 1.0
        torch.testing.assert_close(p.detach(), bases[name].detach() * gain, rtol=1e-6, atol=0, msg=name)
    assert released_subln("encoder", True, N_E, N_D) != 1.0


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


# --- the six variants (closed-form Admin, torchscale DeepNorm, Sub-LN; encoder-decoder and decoder-only)
# against small ports of the released code, written here from the cited lines: each takes the layer
# counts and torchscale's ``is_encoder_decoder`` (True for the translation model, False for the LM)


def released_admin_omega(stack: str, is_encoder_decoder: bool, n: int, m: int) -> float:
    """admin-torch @ 08b6605: ``calculate_init(num_res_layers)`` (admin.py:54-81) with the stack's residual
    layers counted as admin.py:64 and 125 do ("2n" for n encoder layers: one per sub-layer), a decoder layer
    having three sub-layers with cross-attention and two without."""
    if stack == "encoder":
        return admin_torch_calculate_init(2 * n, "O(logn)")
    return admin_torch_calculate_init((3 if is_encoder_decoder else 2) * m, "O(logn)")


def released_deepnorm(stack: str, is_encoder_decoder: bool, n: int, m: int) -> tuple:
    """torchscale @ 4d1e0e8: ``(alpha, init_scale)``; encoder.py:78-89 and 235-244, decoder.py:89-95 and 286-290."""
    if stack == "encoder":
        if is_encoder_decoder:
            alpha = math.pow(math.pow(n, 4) * m, 0.0625) * 0.81
            init_scale = math.pow(math.pow(n, 4) * m, 0.0625) / 1.15
        else:
            alpha, init_scale = math.pow(2.0 * n, 0.25), math.pow(8.0 * n, 0.25)
        return alpha, init_scale
    if is_encoder_decoder:
        return math.pow(3.0 * m, 0.25), math.pow(12.0 * m, 0.25)
    return math.pow(2.0 * m, 0.25), math.pow(8.0 * m, 0.25)


def released_subln(stack: str, is_encoder_decoder: bool, n: int, m: int) -> float:
    """torchscale @ 4d1e0e8: Sub-LN's ``init_scale``; encoder.py:254-262, decoder.py:300-304."""
    if stack == "encoder":
        if is_encoder_decoder:
            return math.sqrt(math.log(3 * m) * math.log(2 * n) / 3)
        return math.sqrt(math.log(n * 2))
    if is_encoder_decoder:
        return math.sqrt(math.log(m * 3))
    return math.sqrt(math.log(m * 2))


def released_scaled(stack: str, name: str, method: str) -> bool:
    """Which parameters torchscale scales, by name (encoder.py:245-251 / 263-269, decoder.py:291-297 /
    305-313: Sub-LN skips the decoder's cross-attention)."""
    if method == "subln" and stack == "decoder" and "encoder_attn" in name:
        return False
    return any(k in name for k in ("fc1", "fc2", "out_proj", "v_proj"))


def test_the_released_ports_give_the_issues_hand_values():
    """The ports against values computed by hand (6 layers)."""
    assert released_admin_omega("decoder", False, 0, 6) == pytest.approx(math.sqrt(13 / math.log(13) - 1))
    assert released_admin_omega("decoder", False, 0, 6) == pytest.approx(2.0170092, abs=1e-7)
    assert released_admin_omega("decoder", True, 6, 6) == pytest.approx(2.3351322, abs=1e-7)
    assert released_deepnorm("decoder", False, 0, 6) == pytest.approx((12**0.25, 48**0.25))
    assert released_deepnorm("decoder", False, 0, 6)[1] == pytest.approx(2.6321480, abs=1e-7)
    assert released_deepnorm("decoder", True, 6, 6)[1] == pytest.approx(2.9129506, abs=1e-7)
    assert released_subln("decoder", False, 0, 6) == pytest.approx(1.5763586, abs=1e-7)  # sqrt(ln 12)
    assert released_subln("decoder", True, 6, 6) == pytest.approx(1.7001093, abs=1e-7)  # sqrt(ln 18)


ENC_DEC_LAYERS = [(6, 6), (12, 12), (24, 24), (6, 24), (24, 6)]  # unequal depths: an N/M mix-up shows
DEC_ONLY_LAYERS = [6, 12, 24]
SHAPES = [(True, nm) for nm in ENC_DEC_LAYERS] + [(False, (0, m)) for m in DEC_ONLY_LAYERS]
SHAPE_IDS = [f"enc-dec-{n}-{m}" if ed else f"dec-only-{m}" for ed, (n, m) in SHAPES]


def _build(family: str, is_encoder_decoder: bool, n: int, m: int, *cli: str, seed: int = 1):
    """The translation model (torchscale's is_encoder_decoder) or the language model, tiny dims."""
    from test_lm import build_lm

    if is_encoder_decoder:
        return build_model(f"{family}_iwslt_de_en", *dims(layers=(n, m)), *cli, seed=seed)
    lm_dims = ("--decoder-layers", str(m), "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
               "--decoder-attention-heads", "2", "--dropout", "0")  # fmt: skip
    model, args, _ = build_lm(f"{family}_lm_tiny", *lm_dims, *cli, seed=seed)
    return model, args


def _stacks(model) -> dict:
    return {stack: getattr(model, stack).layers for stack in ("encoder", "decoder") if hasattr(model, stack)}


@pytest.mark.parametrize("is_encoder_decoder,layers", SHAPES, ids=SHAPE_IDS)
def test_closed_form_admin_equals_admin_torch(is_encoder_decoder, layers):
    n, m = layers
    model, _ = _build("admin_closed", is_encoder_decoder, n, m)
    for stack, stack_layers in _stacks(model).items():
        want = released_admin_omega(stack, is_encoder_decoder, n, m)
        for i, layer in enumerate(stack_layers):
            for sub, res in layer.residuals.items():
                assert bool(res.profiled), (stack, i, sub)
                # omega is filled from a float64 value: one fp32 rounding
                torch.testing.assert_close(
                    res.omega.detach(), torch.full_like(res.omega, want), rtol=2**-23, atol=0, msg=(stack, i, sub)
                )


@pytest.mark.parametrize("is_encoder_decoder,layers", SHAPES, ids=SHAPE_IDS)
def test_torchscale_deepnorm_equals_the_released_init(is_encoder_decoder, layers):
    """Every projection as torchscale leaves it: nn.Linear's U(+-1/sqrt(fan_in)) for weight and bias, divided by
    init_scale where the released code divides; pooled per stack and per group, w / bound ~ U(-1, 1)."""
    n, m = layers
    model, _ = _build("deepnorm_torchscale", is_encoder_decoder, n, m, seed=n + m)
    for stack, stack_layers in _stacks(model).items():
        alpha, init_scale = released_deepnorm(stack, is_encoder_decoder, n, m)
        pooled: dict = {}
        for layer in stack_layers:
            for res in layer.residuals.values():
                assert res.alpha == pytest.approx(alpha, rel=1e-12), stack
            params = dict(layer.named_parameters())
            for name, p in params.items():
                if "layer_norm" in name:
                    continue
                weight = params[name[: -len("bias")] + "weight"] if name.endswith("bias") else p
                bound = weight.size(1) ** -0.5  # nn.Linear.reset_parameters: fan_in = in_features
                divided = released_scaled(stack, name, "deepnorm")
                if divided:
                    bound /= init_scale
                group = (divided, name.endswith("bias"))
                pooled.setdefault(group, []).append(p.detach().flatten() / bound)
        assert set(pooled) == {(True, False), (True, True), (False, False), (False, True)}, stack
        for group, values in pooled.items():
            assert_uniform(torch.cat(values), 1.0, f"{stack} divided={group[0]} bias={group[1]}")


@pytest.mark.parametrize("is_encoder_decoder,layers", SHAPES, ids=SHAPE_IDS)
def test_subln_gain_equals_the_released_init(is_encoder_decoder, layers):
    """Sub-LN's model = the same seed's Pre-LN fairseq-init model with the released parameters times init_scale."""
    n, m = layers
    sub, _ = _build("subln", is_encoder_decoder, n, m, seed=n + m)
    family = "preln"
    base, _ = _build(family, is_encoder_decoder, n, m, "--init-scheme", "fairseq", seed=n + m)
    bases = dict(base.named_parameters())
    scaled = 0
    for name, p in sub.named_parameters():
        if ".layers." not in name or ".norm." in name:  # the inner norms are Sub-LN's own (ones and zeros)
            continue
        stack = name.split(".")[0]
        gain = released_subln(stack, is_encoder_decoder, n, m) if released_scaled(stack, name, "subln") else 1.0
        scaled += gain != 1.0
        # the gain is a float64 product rounded to fp32 once, then the product once: two roundings
        torch.testing.assert_close(p.detach(), bases[name].detach() * gain, rtol=2**-22, atol=0, msg=name)
    assert scaled == 8 * (n + m)  # weight and bias of v_proj, out_proj, fc1, fc2 in every layer


@pytest.mark.parametrize("is_encoder_decoder", [True, False])
def test_every_layer_carries_its_stack_kind(is_encoder_decoder):
    """The kind is set where the layer is built, from what it is built with (no flag of the model's)."""
    model, _ = _build("postln", is_encoder_decoder, 2, 3)
    kinds = {stack: {layer.kind.name for layer in layers} for stack, layers in _stacks(model).items()}
    want = {"encoder": {"encoder"}, "decoder": {"decoder"}} if is_encoder_decoder else {"decoder": {"decoder-only"}}
    assert kinds == want
    for layers in _stacks(model).values():
        for layer in layers:
            assert tuple(layer.residuals) == layer.kind.sublayers


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


@pytest.mark.parametrize("padded", [False, True])
def test_normformer_encoder_applies_the_decoders_operations(padded):
    model, args = _normformer_model()
    ours = model.encoder.layers[0]
    names = {n for n, _ in ours.named_parameters()}
    assert {"attn_ln.weight", "c_attn", "ffn_layernorm.weight", "w_resid"} <= names
    ref = TransformerEncoderLayerBase(TransformerConfig.from_namespace(args))  # no NormFormer in fairseq's encoder
    ref.load_state_dict({k: v for k, v in ours.state_dict().items() if k in ref.state_dict()}, strict=True)
    ref.eval()
    x = torch.randn(5, 2, 32)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2]) if padded else None
    with torch.no_grad():
        # fairseq/modules/transformer_layer.py:460-466 and 508-514, on the encoder
        a, _ = ref.self_attn(query=ln(x, ours.self_attn_layer_norm), key=ln(x, ours.self_attn_layer_norm),
                             value=ln(x, ours.self_attn_layer_norm), key_padding_mask=pad)  # fmt: skip
        a = (a.view(5, 2, 2, 16) * ours.c_attn.view(1, 1, 2, 1)).reshape(5, 2, 32)
        r = x + ln(a, ours.attn_ln)
        h = F.relu(ref.fc1(ln(r, ours.final_layer_norm)))
        want = ours.w_resid * r + ref.fc2(ln(h, ours.ffn_layernorm))
        torch.testing.assert_close(ours(x, pad), want, rtol=1e-5, atol=1e-5)


NORMFORMER_PARAMS = (
    "c_attn",
    "attn_ln.weight",
    "attn_ln.bias",
    "ffn_layernorm.weight",
    "ffn_layernorm.bias",
    "w_resid",
)


def _encoder_out(model) -> torch.Tensor:
    batch = tiny_batch()
    return model.encoder(batch["src_tokens"], batch["src_lengths"])["encoder_out"][0]


def test_normformer_has_no_hooks_that_rewrite_outputs():
    model, _ = _normformer_model()
    hooked = [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooked


@pytest.mark.parametrize("layer", [0, N_E - 1])
@pytest.mark.parametrize("param", NORMFORMER_PARAMS)
def test_normformer_copy_computes_with_its_own_parameters(param, layer):
    """fairseq's EMA deep-copies the model (fairseq/models/ema/ema.py:79): a copy's encoder reads the copy's
    NormFormer parameters, the original's output is untouched, and a state-dict round trip keeps the copy's."""
    model, args = _normformer_model()
    with torch.no_grad():
        before = _encoder_out(model)
        twin = copy.deepcopy(model)
        assert torch.equal(_encoder_out(twin), before)
        twin.get_parameter(f"encoder.layers.{layer}.{param}").add_(0.25)
        changed = _encoder_out(twin)
        assert (changed - before).abs().max() > 1e-3, param
        assert torch.equal(_encoder_out(model), before)
        fresh, _ = _normformer_model()
        fresh.load_state_dict(twin.state_dict())
        assert torch.equal(_encoder_out(fresh), changed)


def test_fairseq_ema_model_computes_with_its_own_normformer_weights():
    """fairseq's EMA class on a NormFormer model: the EMA model's output is that of its own (averaged) weights."""
    from fairseq.dataclass.configs import EMAConfig
    from fairseq.models.ema import EMA

    model, _ = _normformer_model()
    ema = EMA(model, EMAConfig(store_ema=True, ema_decay=0.5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("encoder.") and any(name.endswith(k) for k in NORMFORMER_PARAMS):
                p.add_(1.0)
    ema.step(model)  # the EMA's NormFormer weights move halfway
    averaged, _ = _normformer_model()
    averaged.load_state_dict(ema.get_model().state_dict())
    with torch.no_grad():
        got = _encoder_out(ema.get_model())
        assert torch.equal(got, _encoder_out(averaged))
        assert (got - _encoder_out(model)).abs().max() > 1e-3


def test_ema_of_a_normformer_run_is_fairseqs_average(synthetic_bin, tmp_path):
    """20 updates with fairseq's --store-ema: the EMA in every checkpoint is the average of the saved weights
    by fairseq's rule (models/ema/ema.py:137-205, trainer.py:1040-1047): built from the model at the first
    update, then after update u ``e = d e + (1 - d) w_u`` with d = 0 before --ema-start-update and
    --ema-decay from there on. Computed here in float64 from the weights of each update's checkpoint."""
    decay, start, updates = 0.75, 5, 20
    run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", "normformer_iwslt_de_en", *dims(), "--scale-resids", "--optimizer", "adam", "--lr", "3e-3",
        "--max-tokens", "500", "--max-update", str(updates), "--cpu", "--num-workers", "0", "--seed", "1",
        "--disable-validation", "--save-dir", tmp_path, "--save-interval-updates", "1", "--no-last-checkpoints",
        "--no-epoch-checkpoints", "--store-ema", "--ema-decay", str(decay), "--ema-start-update", str(start),
        "--log-format", "simple",
    )  # fmt: skip
    expected: dict = {}
    for u in range(1, updates + 1):
        (path,) = tmp_path.glob(f"checkpoint_*_{u}.pt")
        state = torch.load(path, weights_only=False)
        weights = {k: v.double() for k, v in state["model"].items() if v.is_floating_point() and "version" not in k}
        d = decay if u >= start else 0.0
        for k, w in weights.items():
            e, peak = expected.get(k, (w, w.abs().max().item()))
            expected[k] = (d * e + (1 - d) * w, max(peak, w.abs().max().item()))
        ema = state["extra_state"]["ema"]
        assert set(weights) <= set(ema)  # the final Pre-LN norms included (stack_build.keep_version)
        for k in ("encoder.version", "decoder.version"):  # not averaged, and not reset to fairseq's "version 1"
            assert torch.equal(ema[k], state["model"][k]), k
        for k, (e, peak) in expected.items():
            # fp32 per update: d * e, (1 - d) * w, their sum and the fp32 d, 1 - d: <= 4 unit roundoffs of the
            # largest magnitude; earlier errors shrink by d, so they sum to at most 4 u peak / (1 - d)
            tol = 4 * 2**-24 * peak / (1 - decay)
            torch.testing.assert_close(ema[k].double(), e, rtol=0, atol=tol, msg=f"update {u}: {k}")
    last = {k: v.double() for k, v in state["model"].items()}
    moved = [k for k in expected if k.startswith("encoder.layers.") and k.endswith(NORMFORMER_PARAMS)]
    assert len(moved) == len(NORMFORMER_PARAMS) * N_E
    for k in moved:  # the average is not the last model: the check above is not trivially met
        assert (expected[k][0] - last[k]).abs().max() > 100 * 4 * 2**-24 * expected[k][1] / (1 - decay), k


# --- bad inputs --------------------------------------------------------------------------------------

BAD = [
    ("subln_iwslt_de_en", ["--norm-type", "none"], "--norm-type none"),
    ("subln_iwslt_de_en", ["--init-scheme", "t-fixup"], "--init-scheme t-fixup"),
    ("deepinit_tiny", ["--subln"], "--encoder-normalize-before"),
    ("subln_iwslt_de_en", ["--scale-fc"], "--subln does not combine with --scale-fc"),
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
