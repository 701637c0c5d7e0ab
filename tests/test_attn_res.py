"""Attention Residuals (``--attention-residuals full|block``; fairseq_deepinit/methods/attention_residuals.py,
modules/attn_res.py) against the independent port of the release's pseudocode, MoonshotAI/Attention-Residuals @
85e2231 ``README.md:52-91`` (``tests/ports/attn_res.py``: ``blocks`` and ``partial_block`` lists, ``[B, T, D]``).

With identical weights, every pseudo-query and key-norm gain moved away from its init (zero and one: at init every
aggregation is a plain mean, which would hide a wrong source order or a misplaced boundary): the whole encoder,
decoder (cross-attention an aggregation of its own) and decoder-only stack in float64, Full AttnRes and Block AttnRes
with 1 and 2 layers per block (3 layers: a block left partial at the end), against the port's layer loop composed
with ``ports.common``'s attention, FFN and LayerNorm; deliberate mutations of the port (the partial block committed
before the aggregation instead of after it, keys not normalised, the final aggregation left out, a boundary one layer
late) must fail the same comparison; step-by-step decoding with beam reordering equal to the full forward; the
refusals; the export refusal; fairseq-train per family.

Tolerance: float64. The longest chain is 3 layers x 3 sub-layers, each a softmax over at most 10 sources and inner
products of length <= 32: far below 1e-12 relative; ``TOL`` is 1e-10 absolute on O(1) outputs. Each mutation moves the
outputs by 1e-3 to O(1).
"""

from __future__ import annotations

import pytest
import torch
from ports import attn_res as port
from ports.common import AttnWeights, FFNWeights, NormSpec, attention, ffn
from test_lm import build_lm

from conftest import assert_beam_decoding_is_the_full_forward, build_model, generate_test, padded_tokens, train_tiny_lm
from deepinit_tools import fairseq_argv as fa
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.attn_res import AttnResResidual, DepthAttention

D, FF, H, L = 16, 32, 2, 3
DIMS = fa.dims(L, D, FF, H)
LM_DIMS = fa.dims(L, D, FF, H, stacks=("decoder",))
# fairseq's explicit attention path runs its softmax in float32 whatever the dtype; the SDPA path keeps float64
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0", "--attention-impl", "sdpa")
PAD = 1
TOL = dict(atol=1e-10, rtol=0)
# kind -> (family, flags, the port's block_layers: None is Full AttnRes)
KINDS = {
    "full": ("attnres", (), None),
    "block1": ("blockattnres", ("--attn-res-block-layers", "1"), 1),
    "block2": ("blockattnres", (), 2),
}
ATTENTION_FEATURES = ("--gated-attention", "--attention-sinks", "--value-residual")


def perturb(model: torch.nn.Module, seed: int = 5) -> None:
    """Norm gains/biases, every pseudo-query and key-norm gain away from their init."""
    g = torch.Generator().manual_seed(seed)

    def rnd(p, scale, base=0.0):
        p.copy_(base + scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("layer_norm" in name or "layernorm" in name) and ".residuals." not in name:
                rnd(p, 0.2, 1.0 if name.endswith("weight") else 0.0)
        for m in model.modules():
            if isinstance(m, DepthAttention):
                rnd(m.pseudo_query, 1.0)
                rnd(m.key_norm_weight, 0.3, 1.0)


def mt(kind: str, *cli: str):
    family, flags, _ = KINDS[kind]
    model, args = build_model(f"{family}_iwslt_de_en", *DIMS, *NO_DROPOUT, *flags, *cli)
    perturb(model)
    for layer in model.decoder.layers:
        layer.need_attn = False  # eval mode would ask for the cross-attention's weights: fairseq's float32 path
    return model.double().eval(), args


def lm(kind: str, *cli: str):
    family, flags, _ = KINDS[kind]
    model, args, _ = build_lm(f"{family}_lm_tiny", *LM_DIMS, *NO_DROPOUT, *flags, *cli)
    perturb(model)
    return model.double().eval(), args


# ---- the port side -----------------------------------------------------------------------------------------


def query(m: DepthAttention) -> port.Query:
    return port.Query(m.pseudo_query.detach(), m.key_norm_weight.detach(), m.eps)


def port_layers(stack, mask=None, enc=None, enc_mask=None, causal=False):
    """Each layer's sub-layers as the port takes them: ``(query, branch)`` in forward order."""
    layers = []
    for layer in stack.layers:
        r = layer.residuals
        ln, sa = NormSpec.from_module(layer.self_attn_layer_norm), AttnWeights.from_module(layer.self_attn)
        subs = [(query(r["self_attn"]), _attend(ln, sa, causal=causal, key_padding_mask=mask))]
        if "encoder_attn" in r:
            lnc, ca = NormSpec.from_module(layer.encoder_attn_layer_norm), AttnWeights.from_module(layer.encoder_attn)
            subs.append((query(r["encoder_attn"]), _attend(lnc, ca, kv=enc, key_padding_mask=enc_mask)))
        lnf, fw = NormSpec.from_module(layer.final_layer_norm), FFNWeights.from_module(layer)
        subs.append((query(r["ffn"]), lambda z, lnf=lnf, fw=fw: ffn(lnf(z), fw)))
        layers.append(subs)
    return layers


def _attend(norm, w, kv=None, **kw):
    def branch(z):
        q = norm(z)
        return attention(q, q if kv is None else kv, w, H, **kw)

    return branch


def port_stack(stack, x0, kind, **kw):
    return port.stack(
        x0, port_layers(stack, **kw), query(stack.attn_res_output), NormSpec.from_module(stack.layer_norm),
        KINDS[kind][2],
    )  # fmt: skip


def encoder_input(encoder, src: torch.Tensor) -> torch.Tensor:
    x, _ = encoder.forward_embedding(src)
    return x * (1 - src.eq(PAD).unsqueeze(-1).to(x))


def decoder_input(decoder, prev: torch.Tensor) -> torch.Tensor:
    return decoder.embed_scale * decoder.embed_tokens(prev) + decoder.embed_positions(prev)


def translation(model, kind: str, stack_fn=port_stack):
    """``(plugin encoder_out, plugin decoder features, port encoder_out, port decoder features)``."""
    src, prev = padded_tokens(3, 7, 0, pad_first_row=2), padded_tokens(3, 5, 1)
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=src.ne(PAD).sum(1))
        # alignment_layer -1: no layer returns attention weights (which fairseq computes in float32)
        feats = model.decoder(prev, encoder_out=enc, features_only=True, alignment_layer=-1)[0]
        mask = src.eq(PAD)
        want_enc = stack_fn(model.encoder, encoder_input(model.encoder, src), kind, mask=mask)
        want = stack_fn(model.decoder, decoder_input(model.decoder, prev), kind, enc=want_enc, enc_mask=mask,
                        causal=True)  # fmt: skip
    return enc["encoder_out"][0].transpose(0, 1), feats, want_enc, want


# ---- the stacks against the port ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_translation_stacks_equal_the_port(kind):
    model, _ = mt(kind)
    got_enc, got, want_enc, want = translation(model, kind)
    assert got_enc.shape == (3, 7, D)  # fairseq's (S, B, d) before the transpose: one aggregation leaves the encoder
    torch.testing.assert_close(got_enc, want_enc, **TOL)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", list(KINDS))
def test_language_model_stack_equals_the_port(kind):
    model, _ = lm(kind)
    prev = padded_tokens(3, 9, 2)
    with torch.no_grad():
        feats = model.decoder(prev, features_only=True)[0]
        want = port_stack(model.decoder, decoder_input(model.decoder, prev), kind, causal=True)
    torch.testing.assert_close(feats, want, **TOL)


def _commit_first(blocks, hidden_states, sublayers, boundary):
    """Mutation: the partial block committed before the layer's first aggregation instead of after it."""
    partial = hidden_states
    for j, (q, branch) in enumerate(sublayers):
        if boundary(j):
            blocks, partial = blocks + [partial], None
        h = port.block_attn_res(blocks, partial if partial is not None else torch.zeros_like(blocks[-1]), q)
        out = branch(h)
        partial = out if partial is None else partial + out
    return blocks, partial


def _unnormalised_keys(blocks, partial_block, q):
    """Mutation: logits against the sources themselves, no RMSNorm."""
    v = torch.stack(blocks + [partial_block])
    logits = torch.einsum("d, n b t d -> n b t", q.proj, v)
    return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), v)


def _no_final_aggregation(x0, layers, final, final_norm, block_layers):
    """Mutation: the stack's output is the plain sum of its sources (the residual stream), not an aggregation."""
    blocks, partial = [], x0
    for number, subs in enumerate(layers):
        boundary = (lambda j: True) if block_layers is None else (lambda j, n=number: j == 0 and n % block_layers == 0)
        blocks, partial = port.layer(blocks, partial, subs, boundary)
    return final_norm(torch.stack(blocks + [partial]).sum(0))


def _late_boundary(x0, layers, final, final_norm, block_layers):
    """Mutation: layers numbered from 1 (a boundary one layer late)."""
    blocks, partial = [], x0
    for number, subs in enumerate(layers, start=1):
        blocks, partial = port.layer(blocks, partial, subs, lambda j, n=number: j == 0 and n % block_layers == 0)
    return final_norm(port.block_attn_res(blocks, partial, final))


MUTATIONS = {
    "commit-before-aggregation": ("block2", "layer", _commit_first),
    "unnormalised-keys": ("full", "block_attn_res", _unnormalised_keys),
    "no-final-aggregation": ("full", "stack", _no_final_aggregation),
    "late-boundary": ("block2", "stack", _late_boundary),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_mutated_port_fails_the_comparison(name, monkeypatch):
    """The comparison can fail: each mutation of the port, on the same model, is off by far more than TOL."""
    kind, attr, fn = MUTATIONS[name]
    model, _ = mt(kind)
    monkeypatch.setattr(port, attr, fn)
    got_enc, got, want_enc, want = translation(model, kind)
    assert (got - want).abs().max() > 1e-4 and (got_enc - want_enc).abs().max() > 1e-4


def test_blocks_open_where_the_release_commits():
    """Block AttnRes with 2 layers per block: layers 1 and 3 open a block at their first sub-layer (the release's
    ``layer_number % (block_size // 2) == 0`` from 0); Full AttnRes: every sub-layer opens one."""
    model, _ = build_model("blockattnres_iwslt_de_en", *DIMS)
    opens = [[r.opens_block for r in layer.residuals.values()] for layer in model.decoder.layers]
    assert opens == [[True, False, False], [False, False, False], [True, False, False]]
    full, _ = build_model("attnres_iwslt_de_en", *DIMS)
    assert all(m.opens_block for m in full.modules() if isinstance(m, AttnResResidual))


def test_at_init_every_aggregation_is_the_mean_of_its_sources():
    """Zero pseudo-queries (uniform weights at init, "must be initialized to zero" as the releases' ports quote the
    paper) and unit key gains."""
    model, _ = build_model("attnres_iwslt_de_en", *DIMS)
    aggregations = [m for m in model.modules() if isinstance(m, DepthAttention)]
    assert len(aggregations) == 2 * L + 3 * L + 2  # every sub-layer and each stack's output
    for m in aggregations:
        assert not m.pseudo_query.any() and bool((m.key_norm_weight == 1).all())
    v = torch.randn(4, 2, 5, D, dtype=torch.float64)
    torch.testing.assert_close(aggregations[0].double().aggregate(v), v.mean(-2), **TOL)


# ---- decoding ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("features", [(), ATTENTION_FEATURES], ids=["", "attention-features"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
def test_incremental_decoding_with_beam_reordering_equals_the_full_forward(kind, lm_, features):
    """As fairseq's SequenceGenerator: 2 sentences x beam 2, each step's order within a sentence's beams. The
    depth-wise sources are per position and rebuilt in every step's forward (nothing cached besides the
    self-attention's keys and values)."""
    model, _ = lm(kind, *features) if lm_ else mt(kind, *features)
    assert_beam_decoding_is_the_full_forward(model, lm_, TOL, pad=PAD)


COMPOSES = [("--qk-norm",), ("--subln",), ("--scale-attn", "--scale-fc", "--scale-heads"), ("--layernorm-scaling",),
            ("--norm-type", "rmsnorm"), ("--norm-type", "dyt"), ("--checkpoint-activations",),
            ("--cross-self-attention", "--attention-impl", "fairseq")]  # fmt: skip


@pytest.mark.parametrize("flags", COMPOSES, ids=[" ".join(f) for f in COMPOSES])
def test_composes_with_the_other_pre_ln_features(flags):
    """Each builds with Block AttnRes and decodes step by step as its full forward. ``--cross-self-attention`` runs
    on fairseq's attention path, whose softmax is float32 whatever the dtype: the tolerance there is float32's."""
    model, _ = mt("block2", *flags)
    src, prev = padded_tokens(2, 7, 10, pad_first_row=3), padded_tokens(2, 5, 3)
    tol = dict(atol=1e-6, rtol=0) if "--cross-self-attention" in flags else TOL
    state: dict = {}
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=src.ne(PAD).sum(1))
        for t in range(1, 6):
            step = model.decoder(prev[:, :t], encoder_out=enc, incremental_state=state)[0][:, -1]
            torch.testing.assert_close(step, model.decoder(prev[:, :t], encoder_out=enc)[0][:, -1], **tol)


# ---- refusals ----------------------------------------------------------------------------------------------


REFUSALS = [
    ("postln", ["--attention-residuals", "full"], "--attention-residuals full is defined on Pre-LN"),
    ("preln", ["--attention-residuals", "block", "--norm-placement", "peri"], "is defined on Pre-LN"),
    ("attnres", ["--hyper-connections", "hc"],
     "sets --residual-scale attention-residuals and --residual-scale hyper-connections"),
    ("hc", ["--attention-residuals", "block"], "--residual-scale"),
    ("attnres", ["--residual-scale", "rezero"],
     "sets --residual-scale attention-residuals and --residual-scale rezero"),
    ("deepnorm", ["--attention-residuals", "full"], "--residual-scale deepnorm"),
    ("resi_dual", ["--attention-residuals", "full"], "--residual-scale resi-dual"),
    ("attnres", ["--depth-mup"], "(set by --depth-mup) is another"),
    ("attnres", ["--init-scheme", "t-fixup"], "removes the norms"),
    ("mixln", ["--attention-residuals", "full"], "--mix-ln"),
    ("attnres", ["--decoder-layer-type", "matt"], "--decoder-layer-type matt"),
    ("attnres", ["--scale-resids"], "does not combine with --scale-resids"),
    ("blockattnres", ["--attn-res-block-layers", "0"], "--attn-res-block-layers must be an integer >= 1"),
    ("attnres", ["--attn-res-block-layers", "2"],
     "--attn-res-block-layers only applies to --attention-residuals block, not full"),
    ("preln", ["--attn-res-eps", "1e-6"], "--attn-res-eps only applies to --attention-residuals"),
    ("attnres", ["--attn-res-eps", "0"], "--attn-res-eps must be a finite number greater than 0"),
    ("preln", ["--residual-scale", "attention-residuals"], "is set by --attention-residuals"),
]  # fmt: skip


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
    assert model.spec.residual == "attention-residuals"
    p = model.spec.features["attention_residuals"]
    assert (p.attn_res_block_layers is None) == (kind == "full")


@pytest.mark.parametrize("lm_", [False, True], ids=["mt", "lm"])
@pytest.mark.parametrize("family, kind", [("attnres", "full"), ("blockattnres", "block")])
def test_the_export_refuses_every_target_and_says_why(family, kind, lm_):
    from fairseq_deepinit.export.route import TARGETS, classify
    from fairseq_deepinit.family_args import resolved_args

    route = classify(resolved_args(family, (), lm_))
    why = (f"--attention-residuals {kind} feeds every sub-layer a learned softmax over the earlier sub-layers' "
           "outputs; neither target has more than one residual stream")  # fmt: skip
    assert route.reasons == {target: why for target in TARGETS}


# ---- fairseq-train -----------------------------------------------------------------------------------------


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
@pytest.mark.parametrize("family", ["attnres", "blockattnres"])
def test_fairseq_train_reload_and_generate(synthetic_bin, tmp_path, family):
    import re

    from conftest import TINY_DIMS, train_and_reload

    log, model = train_and_reload(synthetic_bin, tmp_path / "ckpt", "--arch", f"{family}_iwslt_de_en", *TINY_DIMS)
    assert "residual=attention-residuals" in log and "attn-res " in log, log[-2000:]
    assert re.search(r"num_updates 2\b", log) and "done training" in log, log[-2000:]
    moved = [m.pseudo_query for m in model.modules() if isinstance(m, DepthAttention)]
    assert moved and any(q.abs().max() > 0 for q in moved)  # the queries were trained and stored
    gen = generate_test(synthetic_bin, tmp_path / "ckpt" / "checkpoint_last.pt")
    assert len(re.findall(r"^H-\d+\t", gen, flags=re.M)) == 100, gen[-2000:]


@pytest.mark.kernel_independent
@pytest.mark.parametrize("family", ["attnres", "blockattnres"])
def test_fairseq_train_language_model(lm_bin, tmp_path, family):
    import re

    out = train_tiny_lm(lm_bin, tmp_path, f"{family}_lm_tiny")
    assert "residual=attention-residuals" in out and "done training" in out, out[-2000:]
    assert re.search(r"num_updates 3\b", out), out[-2000:]
    losses = [float(v) for v in re.findall(r"\| loss ([0-9.]+) \|", out)]
    assert losses and all(v == v and v < 100 for v in losses), out[-2000:]


# ---- diagnostics -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "block2"])
def test_depth_diagnostics_measure_the_sum_of_the_sources(kind):
    """The depth statistics see each layer's sources (their count grows over depth) as their sum, the hidden state
    the encoder returns beside its output (``return_all_hiddens``): the angle each layer moves it, per token."""
    from fairseq_deepinit.diagnostics import depth_stats
    from fairseq_deepinit.diagnostics.depth_hooks import DepthStatistics

    model, _ = mt(kind)
    src, prev = padded_tokens(3, 7, 0, pad_first_row=2), padded_tokens(3, 5, 1)
    net = {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1), "prev_output_tokens": prev}
    with torch.no_grad(), DepthStatistics(model, net) as depth:
        model(**net)
    sums = depth.sums()
    with torch.no_grad():
        states = model.encoder(src, src_lengths=src.ne(PAD).sum(1), return_all_hiddens=True)["encoder_states"]
    real = src.ne(PAD).t()
    for i in range(L):
        want = depth_stats.angle_moments(states[i], states[i + 1], real)
        torch.testing.assert_close(sums[f"angle|encoder.layers.{i}"], want, **TOL)
