"""Hyper-connections and mHC (``--hyper-connections hc|mhc``; fairseq_deepinit/methods/hyper_connections.py,
modules/hyper.py) against the independent ports of lucidrains/hyper-connections @ 47751035 and Megatron-LM's mHC
@ d98e8a64 (``tests/ports/hyper_connections.py``, ``tests/ports/mhc.py``).

With identical weights, every hyper-connection parameter moved away from its init (so that a weight read in the
wrong place shows): the whole encoder, decoder (cross-attention a connection of its own) and decoder-only stack
in float64, static and dynamic HC and mHC, against the ports' sub-layer rules composed with ``ports.common``'s
attention, FFN and LayerNorm; mHC's mappings (H_pre, H_post, the Sinkhorn projection H_res) and the gradient of the
recomputing Sinkhorn backward against autograd through the port; the limits at init that the papers and releases
state (HC is Pre-LN, one stream is the plain residual, mHC with its gating factors at 0 is Pre-LN); step-by-step
decoding with beam reordering equal to the full forward; the refusals; the export refusal; fairseq-train per
family (slow).

Tolerance: float64 throughout. The longest chain is a stack of 3 x 2 sub-layers, each a few inner products of
length <= 64 plus 20 Sinkhorn steps (two divisions each): ``S (n + 40) u`` with ``u = 1.1e-16`` is < 1e-12 relative;
``TOL`` is 1e-10 absolute on O(1) outputs. A wrong formula (a transposed H_res, the streams summed instead of
averaged before a LayerNorm of eps 1e-5, beta not applied, a connection reading the wrong stream, Sinkhorn's
order of rows and columns swapped) is off by 1e-6 to O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ports import hyper_connections as hc_port
from ports import mhc as mhc_port
from ports.common import AttnWeights, FFNWeights, NormSpec, attention, ffn
from test_lm import build_lm

from conftest import assert_beam_decoding_is_the_full_forward, build_model, generate_test, padded_tokens, train_tiny_lm
from deepinit_tools import fairseq_argv as fa
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.hyper import HyperConnection, ManifoldHyperConnection, sinkhorn

D, FF, H, L = 16, 32, 2, 2
DIMS = fa.dims(L, D, FF, H)
LM_DIMS = fa.dims(L + 1, D, FF, H, stacks=("decoder",))
# fairseq's explicit attention path (cross-attention, decoding) runs its softmax in float32 whatever the dtype
# (fairseq/utils.py:514-518); the plugin's SDPA path keeps float64, so the comparisons use it
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0", "--attention-impl", "sdpa")
PAD = 1
TOL = dict(atol=1e-10, rtol=0)
KINDS = {"hc": ("hc",), "hc-static": ("hc", "--no-hc-dynamic"), "mhc": ("mhc",)}
# the 2025 attention methods on top (each sub-layer's branch changes, not the connections)
ATTENTION_FEATURES = ("--gated-attention", "--attention-sinks", "--value-residual")


def perturb(model: torch.nn.Module, seed: int = 5) -> None:
    """Norm gains/biases and every hyper-connection parameter away from their init."""
    g = torch.Generator().manual_seed(seed)

    def rnd(p, scale, base=0.0):
        p.copy_(base + scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("layer_norm" in name or "layernorm" in name) and ".residuals." not in name:
                rnd(p, 0.2, 1.0 if name.endswith("weight") else 0.0)
        for m in model.modules():
            if isinstance(m, HyperConnection):
                rnd(m.static_alpha, 0.3, m.static_alpha.detach().clone())
                rnd(m.static_beta, 0.3, 1.0)
                if m.dynamic:
                    for p in (m.norm_gamma, m.dynamic_alpha_fn, m.dynamic_beta_fn):
                        rnd(p, 0.5)
                    rnd(m.dynamic_alpha_scale, 0.2, 0.5)
                    rnd(m.dynamic_beta_scale, 0.2, 0.5)
            elif isinstance(m, ManifoldHyperConnection):
                rnd(m.mapping_proj, 0.3)
                for p in (m.alpha_pre, m.alpha_post, m.alpha_res):
                    rnd(p, 0.3, 1.0)
                rnd(m.bias, 0.5)


def mt(kind: str, *cli: str):
    family, *flags = KINDS[kind]
    model, args = build_model(f"{family}_iwslt_de_en", *DIMS, *NO_DROPOUT, *flags, *cli)
    perturb(model)
    for layer in model.decoder.layers:
        layer.need_attn = False  # eval mode would ask for the cross-attention's weights: fairseq's float32 path
    return model.double().eval(), args


def lm(kind: str, *cli: str):
    family, *flags = KINDS[kind]
    model, args, _ = build_lm(f"{family}_lm_tiny", *LM_DIMS, *NO_DROPOUT, *flags, *cli)
    perturb(model)
    return model.double().eval(), args


# ---- the port side: a stack of sub-layers, each through its connection's released rule --------------------


def connection(module):
    """The port's rule for one plugin connection: ``h (B, T, n, d), branch -> h'``."""
    if isinstance(module, HyperConnection):
        dyn = module.dynamic
        p = hc_port.HCParams(
            module.static_alpha.detach(),
            module.static_beta.detach(),
            module.dynamic_alpha_fn.detach() if dyn else None,
            module.dynamic_beta_fn.detach() if dyn else None,
            module.dynamic_alpha_scale.detach() if dyn else hc_port.SCALE_INIT,
            module.dynamic_beta_scale.detach() if dyn else hc_port.SCALE_INIT,
            module.norm_gamma.detach() if dyn else None,
        )
        return lambda h, branch: hc_port.sublayer(h, branch, p)
    p = mhc_port.MHCParams(
        module.mapping_proj.detach(), module.alpha_pre.detach(), module.alpha_post.detach(),
        module.alpha_res.detach(), module.bias.detach(),
    )  # fmt: skip
    return lambda h, branch: mhc_port.sublayer(h, branch, *mhc_port.mappings_megatron(h, p, module.iters, module.eps))


def port_stack(stack, x0: torch.Tensor, kind: str, mask=None, enc=None, enc_mask=None, causal=False):
    """The port's stack: ``n`` copies of ``x0`` (B, T, d), every sub-layer through its connection, the streams
    summed (HC, lucidrains) or averaged (mHC, Megatron), the final LayerNorm."""
    n = stack.streams.n
    h = hc_port.expand(x0, n)
    for layer in stack.layers:
        r = layer.residuals
        ln, sa = NormSpec.from_module(layer.self_attn_layer_norm), AttnWeights.from_module(layer.self_attn)
        h = connection(r["self_attn"])(h, _attend(ln, sa, causal=causal, key_padding_mask=mask))
        if "encoder_attn" in r:
            lnc, ca = NormSpec.from_module(layer.encoder_attn_layer_norm), AttnWeights.from_module(layer.encoder_attn)
            h = connection(r["encoder_attn"])(h, _attend(lnc, ca, kv=enc, key_padding_mask=enc_mask))
        lnf, fw = NormSpec.from_module(layer.final_layer_norm), FFNWeights.from_module(layer)
        h = connection(r["ffn"])(h, lambda z, lnf=lnf, fw=fw: ffn(lnf(z), fw))
    out = hc_port.reduce(h) if kind != "mhc" else mhc_port.contract_mean(h)
    return NormSpec.from_module(stack.layer_norm)(out)


def _attend(norm, w, kv=None, **kw):
    """The attention branch on its pre-norm's output (keys and values from ``kv``, else the same input)."""

    def branch(z):
        q = norm(z)
        return attention(q, q if kv is None else kv, w, H, **kw)

    return branch


def encoder_input(encoder, src: torch.Tensor) -> torch.Tensor:
    x, _ = encoder.forward_embedding(src)
    return x * (1 - src.eq(PAD).unsqueeze(-1).to(x))


# ---- the stacks against the ports --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_translation_stacks_equal_the_ports(kind):
    model, _ = mt(kind)
    src, prev = padded_tokens(3, 7, 0, pad_first_row=2), padded_tokens(3, 5, 1)
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=src.ne(PAD).sum(1))
        # alignment_layer -1: no layer returns attention weights (which fairseq computes in float32)
        feats = model.decoder(prev, encoder_out=enc, features_only=True, alignment_layer=-1)[0]
        mask = src.eq(PAD)
        want_enc = port_stack(model.encoder, encoder_input(model.encoder, src), kind, mask=mask)
        torch.testing.assert_close(enc["encoder_out"][0].transpose(0, 1), want_enc, **TOL)
        x0 = model.decoder.embed_scale * model.decoder.embed_tokens(prev) + model.decoder.embed_positions(prev)
        want = port_stack(model.decoder, x0, kind, enc=want_enc, enc_mask=mask, causal=True)
    assert enc["encoder_out"][0].shape == (7, 3, D)  # fairseq's (S, B, d): one stream leaves the encoder
    torch.testing.assert_close(feats, want, **TOL)


@pytest.mark.parametrize("kind", list(KINDS))
def test_language_model_stack_equals_the_port(kind):
    model, _ = lm(kind)
    prev = padded_tokens(3, 9, 2)
    with torch.no_grad():
        feats = model.decoder(prev, features_only=True)[0]
        x0 = model.decoder.embed_scale * model.decoder.embed_tokens(prev) + model.decoder.embed_positions(prev)
        want = port_stack(model.decoder, x0, kind, causal=True)
    torch.testing.assert_close(feats, want, **TOL)


def test_connections_are_numbered_per_stack_in_forward_order():
    """x-transformers counts sub-layers: encoder 2 per layer, decoder 3; HC's branch reads stream index mod n."""
    model, _ = build_model("hc_iwslt_de_en", *DIMS)
    for stack, per_layer in ((model.encoder, 2), (model.decoder, 3)):
        for l_, layer in enumerate(stack.layers):
            for j, (name, r) in enumerate(layer.residuals.items()):
                assert r.index == l_ * per_layer + j, (name, r.index)
                col = torch.zeros(4)
                col[r.index % 4] = 1
                torch.testing.assert_close(r.static_alpha[:, 0], col)
                torch.testing.assert_close(r.static_alpha[:, 1:], torch.eye(4))
    assert list(model.decoder.layers[0].residuals) == ["self_attn", "encoder_attn", "ffn"]


# ---- mHC's mappings and Sinkhorn ---------------------------------------------------------------------------


def test_mhc_mappings_equal_megatrons():
    model, _ = mt("mhc")
    module = model.decoder.layers[1].residuals["encoder_attn"]
    x = torch.randn(5, 3, 4, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    p = mhc_port.MHCParams(module.mapping_proj.detach(), module.alpha_pre.detach(), module.alpha_post.detach(),
                           module.alpha_res.detach(), module.bias.detach())  # fmt: skip
    with torch.no_grad():
        got = module.mappings(x)
    for a, b in zip(got, mhc_port.mappings_megatron(x, p), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    h_res = got[2]
    assert (h_res.sum(-2) - 1).abs().max() < 1e-12  # columns last: exact
    assert (h_res.sum(-1) - 1).abs().max() < 1e-2  # rows drift (the non-final axis)


@pytest.mark.parametrize("iters", [1, 20])
def test_sinkhorn_recomputed_backward_equals_autograd_through_the_port(iters):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 4, 4, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    weight = torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
    out = sinkhorn(logits, iters, 1e-6, recompute=True)
    (grad,) = torch.autograd.grad((out * weight).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = mhc_port.sinkhorn_megatron(ref_logits, iters, 1e-6)
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), ref_logits)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, iters, 1e-6), (logits[:2].detach().requires_grad_(),))


def test_sinkhorn_saves_only_its_logits():
    """The recomputing backward keeps ``n^2`` values per token, autograd through the loop every iterate."""
    logits = torch.randn(32, 4, 4, dtype=torch.float64, requires_grad=True)

    def saved(recompute: bool) -> int:
        count = 0

        def pack(t):
            nonlocal count
            count += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sinkhorn(logits, 20, 1e-6, recompute=recompute)
        return count

    assert saved(True) == logits.numel()
    assert saved(False) >= 40 * logits.numel()


# ---- the limits at init --------------------------------------------------------------------------------------


def _same_weights_as_preln(family: str, lm_: bool, own: tuple = (), shared: tuple = ()):
    """``(model, preln)``: the family's model (with its ``own`` flags) holding the Pre-LN model's weights, its
    connections at their init; ``shared`` flags go to both."""
    if lm_:
        model = build_lm(f"{family}_lm_tiny", *LM_DIMS, *NO_DROPOUT, *own, *shared)[0]
        preln = build_lm("preln_lm_tiny", *LM_DIMS, *NO_DROPOUT, *shared)[0]
    else:
        model = build_model(f"{family}_iwslt_de_en", *DIMS, *NO_DROPOUT, *own, *shared)[0]
        preln = build_model("preln_iwslt_de_en", *DIMS, *NO_DROPOUT, *shared)[0]
    perturb(preln)
    missing, unexpected = model.load_state_dict(preln.state_dict(), strict=False)
    assert not unexpected and missing and all(".residuals." in k for k in missing)
    return model.double().eval(), preln.double().eval()


def _outputs(model, lm_: bool) -> torch.Tensor:
    prev = padded_tokens(3, 6, 7)
    with torch.no_grad():
        if lm_:
            return model(prev)[0]
        src = padded_tokens(3, 7, 8, pad_first_row=2)
        return model(src, src.ne(PAD).sum(1), prev)[0]


@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_hc_at_init_is_the_pre_ln_model(lm_, dynamic):
    """Zhu et al.: at init every stream is a copy, the branch reads one, each stream gets x + F(LN(x)); the sum of
    the n streams before the final LayerNorm is n times Pre-LN's stream, LN(n y) = LN(y) up to the eps (1e-30 here)."""
    own = () if dynamic else ("--no-hc-dynamic",)
    model, preln = _same_weights_as_preln("hc", lm_, own, ("--norm-eps", "1e-30"))
    torch.testing.assert_close(_outputs(model, lm_), _outputs(preln, lm_), **TOL)


@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
def test_hc_one_stream_at_init_is_the_plain_residual(lm_):
    """n = 1 with the release's init: alpha = [[1, 1]], beta = 1: ``x + F(LN(x))`` exactly, any eps."""
    model, preln = _same_weights_as_preln("hc", lm_, ("--hc-streams", "1"))
    torch.testing.assert_close(_outputs(model, lm_), _outputs(preln, lm_), **TOL)


@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
def test_mhc_with_gating_factors_at_zero_is_the_pre_ln_model(lm_):
    """Megatron's init with alpha -> 0 (bias 0): H_pre = 1/2, H_post = 1, H_res = J/n; the streams stay copies, the
    branch reads n/2 times the stream, which its LayerNorm removes (eps 1e-30), the mean of the streams is Pre-LN's."""
    model, preln = _same_weights_as_preln("mhc", lm_, (), ("--norm-eps", "1e-30"))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ManifoldHyperConnection):
                for p in (m.alpha_pre, m.alpha_post, m.alpha_res):
                    p.zero_()
    torch.testing.assert_close(_outputs(model, lm_), _outputs(preln, lm_), **TOL)


# ---- decoding --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("features", [(), ATTENTION_FEATURES], ids=["", "attention-features"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
def test_incremental_decoding_with_beam_reordering_equals_the_full_forward(kind, lm_, features):
    """As fairseq's SequenceGenerator: 2 sentences x beam 2, the source repeated per beam, each step's order
    within a sentence's beams (fairseq's cross-attention cache keeps one copy per sentence); also with gated
    attention, sinks and value residual in every branch."""
    model, _ = lm(kind, *features) if lm_ else mt(kind, *features)
    assert_beam_decoding_is_the_full_forward(model, lm_, TOL, pad=PAD)


# ---- refusals --------------------------------------------------------------------------------------------------


REFUSALS = [
    ("postln", ["--hyper-connections", "hc"], "--hyper-connections hc is defined on Pre-LN"),
    ("preln", ["--hyper-connections", "mhc", "--norm-placement", "peri"], "is defined on Pre-LN"),
    ("hc", ["--residual-scale", "rezero"], "sets --residual-scale hyper-connections and --residual-scale rezero"),
    ("hc", ["--init-scheme", "admin"], "--residual-scale admin (needed by --init-scheme admin) is another"),
    ("deepnorm", ["--hyper-connections", "hc"], "--residual-scale deepnorm"),
    ("resi_dual", ["--hyper-connections", "mhc"], "--residual-scale resi-dual"),
    ("b2t", ["--hyper-connections", "hc"], "--residual-scale b2t"),
    ("hc", ["--depth-mup"], "(set by --depth-mup) is another"),
    ("hc", ["--init-scheme", "t-fixup"], "removes the norms"),
    ("mixln", ["--hyper-connections", "hc"], "--mix-ln"),
    ("hc", ["--decoder-layer-type", "matt"], "--decoder-layer-type matt"),
    ("hc", ["--scale-resids"], "does not combine with --scale-resids"),
    ("hc", ["--cross-self-attention"], "does not combine with --cross-self-attention"),
    ("hc", ["--hc-streams", "0"], "--hc-streams must be an integer from 1 to 8, got 0"),
    ("hc", ["--mhc-sinkhorn-iters", "5"], "--mhc-sinkhorn-iters only applies to --hyper-connections mhc, not hc"),
    ("mhc", ["--no-hc-dynamic"], "--hc-dynamic only applies to --hyper-connections hc, not mhc"),
    ("mhc", ["--mhc-eps", "0"], "--mhc-eps must be a finite number greater than 0"),
    ("preln", ["--hc-streams", "2"], "--hc-streams only applies to --hyper-connections hc, not none"),
    ("preln", ["--residual-scale", "hyper-connections"], "is set by --hyper-connections hc or --hyper-connections mhc"),
]


@pytest.mark.parametrize("family, flags, message", REFUSALS, ids=[" ".join([r[0], *r[1]]) for r in REFUSALS])
def test_refusals_are_one_line(family, flags, message):
    with pytest.raises(DeepInitConfigError) as err:
        build_model(f"{family}_iwslt_de_en", *DIMS, *flags)
    text = str(err.value)
    assert message in text and "\n" not in text, text


@pytest.mark.parametrize("kind", list(KINDS))
def test_stored_arguments_resolve_to_the_same_spec(kind):
    from fairseq_deepinit.resolve import resolve

    model, args = mt(kind)
    assert resolve(args) == model.spec
    assert model.spec.residual == "hyper-connections"
    p = model.spec.features["hyper_connections"]
    assert (p.mhc_sinkhorn_iters is None) == (kind != "mhc") and (p.hc_dynamic is None) == (kind == "mhc")


@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
@pytest.mark.parametrize("family", ["hc", "mhc"])
def test_the_export_refuses_every_target_and_says_why(family, lm_):
    from fairseq_deepinit.export.route import TARGETS, classify
    from fairseq_deepinit.family_args import resolved_args

    route = classify(resolved_args(family, (), lm_))
    why = (f"--hyper-connections {family} carries 4 residual streams per token, mixed by learned weights around "
           "every sub-layer; neither target has more than one residual stream")  # fmt: skip
    assert route.reasons == {target: why for target in TARGETS}


# ---- fairseq-train ---------------------------------------------------------------------------------------------


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
@pytest.mark.parametrize("family", ["hc", "mhc"])
def test_fairseq_train_reload_and_generate(synthetic_bin, tmp_path, family):
    import re

    from conftest import TINY_DIMS, train_and_reload

    log, model = train_and_reload(synthetic_bin, tmp_path / "ckpt", "--arch", f"{family}_iwslt_de_en", *TINY_DIMS)
    assert "residual=hyper-connections" in log and f"{family} streams=4" in log, log[-2000:]
    assert re.search(r"num_updates 2\b", log) and "done training" in log, log[-2000:]
    assert model.encoder.streams.n == 4
    gen = generate_test(synthetic_bin, tmp_path / "ckpt" / "checkpoint_last.pt")
    assert len(re.findall(r"^H-\d+\t", gen, flags=re.M)) == 100, gen[-2000:]


@pytest.mark.kernel_independent
@pytest.mark.parametrize("family", ["hc", "mhc"])
def test_fairseq_train_language_model(lm_bin, tmp_path, family):
    import re

    out = train_tiny_lm(lm_bin, tmp_path, f"{family}_lm_tiny")
    assert "residual=hyper-connections" in out and "done training" in out, out[-2000:]
    assert re.search(r"num_updates 3\b", out), out[-2000:]
    losses = [float(v) for v in re.findall(r"\| loss ([0-9.]+) \|", out)]
    assert losses and all(v == v and v < 100 for v in losses), out[-2000:]


def test_dropout_in_training_mode_draws_one_mask_per_branch():
    """The dropped-out branch output is written into every stream with its weight (one mask, not n)."""
    model, _ = build_model("hc_iwslt_de_en", *DIMS, "--dropout", "0.5", "--attention-dropout", "0",
                           "--activation-dropout", "0", "--hc-streams", "2", "--no-hc-dynamic")  # fmt: skip
    layer = model.encoder.layers[0].double().train()
    x = torch.randn(5, 3, D, dtype=torch.float64).unsqueeze(-2).expand(5, 3, 2, D)
    torch.manual_seed(0)
    out = layer(x, torch.zeros(3, 5, dtype=torch.bool))
    # static init: both streams are x + beta F with one F: the two streams are equal
    torch.testing.assert_close(out[..., 0, :], out[..., 1, :], **TOL)
    assert F.mse_loss(out[..., 0, :], x[..., 0, :]) > 0


# ---- diagnostics -----------------------------------------------------------------------------------------------


def test_mhc_diagnostics_log_h_res_norm_and_drift_of_every_connection():
    """The depth statistics (what the diagnostics criterion logs on its updates) keep, per connection, the largest
    spectral norm and row/column-sum drift of H_res over all tokens: the port's ``h_res_diagnostics`` of the same
    H_res; under mHC the stream statistics measure a token's n streams as one vector."""
    from fairseq_deepinit.diagnostics.depth_hooks import DepthStatistics

    model, _ = mt("mhc")
    src, prev = padded_tokens(3, 7, 0, pad_first_row=2), padded_tokens(3, 5, 1)
    net = {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1), "prev_output_tokens": prev}
    with torch.no_grad(), DepthStatistics(model, net) as depth:
        model(**net)
    values = depth.values()
    assert not any(c.observers for c in model.modules() if isinstance(c, ManifoldHyperConnection))  # detached
    subs = {"encoder": ("self_attn", "ffn"), "decoder": ("self_attn", "encoder_attn", "ffn")}
    names = [f"{s}.layers.{i}.{sub}" for s in subs for i in range(L) for sub in subs[s]]
    for kind in ("h_res_norm", "h_res_row_drift", "h_res_col_drift"):
        assert {k.split("/", 1)[1] for k in values if k.startswith(f"diag_{kind}/")} == set(names)
    connection = model.encoder.layers[0].residuals["self_attn"]
    with torch.no_grad():
        x = hc_port.expand(encoder_input(model.encoder, src), 4)
        want = mhc_port.h_res_diagnostics(connection.mappings(x)[2])
    name = "encoder.layers.0.self_attn"
    assert values[f"diag_h_res_norm/{name}"] == pytest.approx(float(want["spectral_norm_max"]), abs=1e-12)
    assert values[f"diag_h_res_row_drift/{name}"] == pytest.approx(float(want["row_sum_drift"]), abs=1e-12)
    assert values[f"diag_h_res_col_drift/{name}"] == pytest.approx(float(want["col_sum_drift"]), abs=1e-12)
    assert values[f"diag_h_res_col_drift/{name}"] < 1e-12 < values[f"diag_h_res_row_drift/{name}"]
    assert values["diag_stream_norm/encoder.layers.0"] > 0
