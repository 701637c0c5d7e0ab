"""LayerNorm Scaling (``fairseq_deepinit/methods/lnscale.py``) against the independent port of its released
code (``tests/ports/layernorm_scaling.py``: lmsdss/LayerNorm-Scaling modeling_llama.py:427-454).

- the factor of every layer (1/sqrt(l), l from 1 per stack) and the models' outputs with identical weights:
  a translation model (encoder and decoder, the decoder's cross-attention pre-norm scaled too) and a
  decoder-only LM, LayerNorm and RMSNorm, in float64 and float32;
- the released runs' N(0, 0.02) init and its depth-scaled variant (``normal``, ``normal-scaled``);
- Post-LN and the other refusals (one line), the one-line warning with a depth-scaled init;
- aten ops of a training update within 2 % of stock fairseq's Pre-LN;
- fairseq-train for translation (saved, reloaded by fairseq's loader) and for an LM.

Tolerances. float64: the plugin's explicit attention path (fairseq's, taken by cross-attention) computes
its softmax in float32 even for float64 input (``fairseq/utils.py:518``): probabilities off by up to
``2**-24`` relative, which the following O(1)-conditioned projections and norms carry to < 1e-6 (the same
bound as tests/test_ports.py); the decoder-only LM has no such step and agrees to 1e-12 (each of its few
hundred float64 roundings is 1.1e-16). float32: the plugin in float32 against the port in float64 on the
same values: each reduction of length n is off by at most ``n u`` relative (u = 2**-24), a layer chains
the reductions of its norms (d each), projections (d), scores (d/H), weighted sum (T) and FFN (d + d_ff),
and each norm's output is O(1) whatever its input, so the error per layer is at most
``sum(n) u`` times the norms' gain (O(1) here): ``TOL32 = 4 L sum(n) u``, about 1e-4. A wrong factor
(1/sqrt(l+1), or an unscaled cross-attention) moves the outputs by 1e-2 to 1e-1.
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from ports import layernorm_scaling as port
from ports.common import AttnWeights, FFNWeights, NormSpec, decoder_input, lm_layers
from test_lm import build_lm as lm_build

from conftest import TRAIN_2, USER_DIR, build_model, perturb_norms, run_cli, tiny_batch, train_and_reload
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.methods import INIT_SCHEMES
from fairseq_deepinit.methods.lnscale import lns_factor

D, FF, H, L = 16, 32, 2, 3
U32 = 2.0**-24
TOL32 = 4 * L * (3 * D + D // H + 7 + D + D + FF) * U32
PRE = ("--encoder-normalize-before", "--decoder-normalize-before")

# the init schemes whose init depends on the depth and that LNS can run with (not Post-LN-only): it warns
DEPTH_SCALED_INITS = sorted(n for n, s in INIT_SCHEMES.items() if s.depth_scaled and not s.requires)


def dims(layers: int = L, d: int = D, ffn: int = FF) -> list:
    return [
        "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
        "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
        "--encoder-attention-heads", str(H), "--decoder-attention-heads", str(H),
        "--encoder-layers", str(layers), "--decoder-layers", str(layers), "--dropout", "0",
    ]  # fmt: skip


def build_lm(*cli: str):
    """``(model, args)`` of ``lnscale_lm_tiny`` built as fairseq-train builds it (tests/test_lm.py)."""
    model, args, _ = lm_build("lnscale_lm_tiny", *cli)
    return model, args


def enc_dec_features(model, batch):
    """The plugin's encoder output and decoder features (after the final norms), batch-first."""
    enc = model.encoder(batch["src_tokens"], src_lengths=batch["src_lengths"])
    feats, _ = model.decoder(batch["prev_output_tokens"], encoder_out=enc, features_only=True)
    return enc["encoder_out"][0].transpose(0, 1), feats


def port_translation(model, batch):
    """The port's encoder-decoder on the plugin's weights: every layer i (from 0) of each stack scaled by
    ``port.lns_factor(i)``, the stacks' final norms unscaled."""
    n = NormSpec.from_module
    x = model.encoder.forward_embedding(batch["src_tokens"])[0]
    for i, layer in enumerate(model.encoder.layers):
        x = port.encoder_layer(x, AttnWeights.from_module(layer.self_attn), FFNWeights.from_module(layer),
                               n(layer.self_attn_layer_norm), n(layer.final_layer_norm), H, i)  # fmt: skip
    memory = n(model.encoder.layer_norm)(x)
    y = decoder_input(model.decoder, batch["prev_output_tokens"])
    for i, layer in enumerate(model.decoder.layers):
        y = port.decoder_layer(y, memory, AttnWeights.from_module(layer.self_attn),
                               AttnWeights.from_module(layer.encoder_attn), FFNWeights.from_module(layer),
                               n(layer.self_attn_layer_norm), n(layer.encoder_attn_layer_norm),
                               n(layer.final_layer_norm), H, i)  # fmt: skip
    return memory, n(model.decoder.layer_norm)(y)


def test_factor_of_every_layer_is_the_released_one():
    for depth in range(1, 49):
        assert lns_factor(depth) == port.lns_factor(depth - 1)
    model, _ = build_model("deepinit_tiny", *dims(), "--layernorm-scaling", *PRE)
    for stack in (model.encoder, model.decoder):
        assert [layer.input_scale for layer in stack.layers] == [port.lns_factor(i) for i in range(L)]
    plain, _ = build_model("deepinit_tiny", *dims(), *PRE)
    assert all(layer.input_scale == 1.0 for layer in plain.decoder.layers)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_translation_model_equals_the_port(norm, dtype):
    model, _ = build_model("lnscale_iwslt_de_en", *dims(), "--norm-type", norm)
    model = model.to(dtype).eval()
    perturb_norms(model)
    batch = tiny_batch()
    with torch.no_grad():
        got = enc_dec_features(model, batch)
        model64 = model.double()
        want = port_translation(model64, batch)
    tol = 1e-6 if dtype == torch.float64 else TOL32
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_language_model_equals_the_port(dtype):
    model, _ = build_lm("--decoder-layers", str(L), "--decoder-embed-dim", str(D), "--decoder-ffn-embed-dim",
                        str(FF), "--decoder-attention-heads", str(H), "--dropout", "0")  # fmt: skip
    model = model.to(dtype).eval()
    perturb_norms(model)
    tokens = tiny_batch()["prev_output_tokens"]
    with torch.no_grad():
        got, _ = model.decoder(tokens, features_only=True)
        dec = model.double().decoder
        want = port.lm_stack(decoder_input(dec, tokens), lm_layers(dec), H, NormSpec.from_module(dec.layer_norm))
    tol = 1e-12 if dtype == torch.float64 else TOL32
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("scaled", [False, True])
def test_normal_init_has_the_released_std(scaled):
    """``normal`` / ``normal-scaled`` against ``port.init_std`` (modeling_llama.py:857-878), per kind of
    weight pooled over the layers: 4 x 64 x 64 draws per kind, the sample std within 5 standard errors
    (1/sqrt(2n) relative, 5.5e-3 at n = 16384: 3 %)."""
    layers = 4
    scheme = "normal-scaled" if scaled else "normal"
    model, _ = build_model("deepinit_tiny", *dims(layers, 64, 64), "--init-scheme", scheme, *PRE,
                           "--layernorm-scaling", n_symbols=500)  # fmt: skip
    kinds = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
             "up": "fc1", "down": "fc2"}  # fmt: skip
    for stack in (model.encoder, model.decoder):
        for kind, path in kinds.items():
            w = torch.cat([lay.get_submodule(path).weight.flatten() for lay in stack.layers])
            want = port.init_std(kind, layers, scaled_init=scaled)
            assert abs(w.std().item() / want - 1) < 5 / math.sqrt(2 * w.numel()), (kind, w.std().item(), want)
            assert all(not lay.get_submodule(path).bias.any() for lay in stack.layers)
        emb = stack.embed_tokens.weight
        assert abs(emb[1:].std().item() / port.init_std("embedding", layers) - 1) < 0.05
        assert not emb[stack.embed_tokens.padding_idx].any()


BAD = [
    (("deepinit_tiny", "--layernorm-scaling"), "--encoder-normalize-before --decoder-normalize-before"),
    (("lnscale_iwslt_de_en", "--norm-type", "none"), "--norm-type none"),
    (("lnscale_iwslt_de_en", "--mix-ln"), "drop one"),
    (("lnscale_iwslt_de_en", "--init-scheme", "deepnorm"), "Post-LN only"),
]


@pytest.mark.parametrize("cli,says", BAD, ids=[" ".join(c) for c, _ in BAD])
def test_refusals_are_one_line(cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(cli[0], *dims(2), *cli[1:])
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("scheme", sorted(DEPTH_SCALED_INITS) + ["normal", "xavier"])
def test_depth_scaled_init_warns_in_one_line(scheme, caplog):
    extra = ("--norm-type", "layernorm", "--force-norm-with-scheme") if scheme == "t-fixup" else ()
    with caplog.at_level(logging.WARNING, logger="fairseq_deepinit.methods.lnscale"):
        build_model("lnscale_iwslt_de_en", *dims(2), "--init-scheme", scheme, *extra)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fairseq_deepinit.methods.lnscale"]
    depth_scaled = scheme in DEPTH_SCALED_INITS
    assert bool(warnings) == port.warns_with(depth_scaled), warnings
    if depth_scaled:
        assert len(warnings) == 1 and "\n" not in warnings[0] and f"--init-scheme {scheme}" in warnings[0]


@pytest.mark.parametrize("kind", ["mt", "lm"])
def test_update_ops_within_2_percent_of_stock(kind):
    """One training update (forward, backward, Adam) of the 4-layer family against stock fairseq Pre-LN:
    one multiplication per scaled pre-norm (layers 2..L) each way, at most 1.02x stock's aten ops."""
    from deepinit_tools.bench import gpu_readiness as gr
    from deepinit_tools.bench.readiness_build import update_ops
    from deepinit_tools.harness.fairseq_train import Shape

    gr.plugin()
    shape = Shape(4, 16, 32, 2)
    plugin, b = update_ops(kind, gr.Family(kind, "lnscale").arch, shape)
    stock, _ = update_ops(kind, gr.stock_arch(kind), shape, *gr.stock_flags(b))
    assert plugin.total <= 1.02 * stock.total, (plugin.total, stock.total, plugin.total / stock.total)


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_translation_saves_and_reloads(synthetic_bin, tmp_path):
    log, model = train_and_reload(synthetic_bin, tmp_path, "--arch", "lnscale_iwslt_de_en", *dims(2))
    assert "layernorm-scaling=1/sqrt(l)" in log and re.search(r"num_updates 2\b", log), log[-2000:]
    assert [layer.input_scale for layer in model.decoder.layers] == [1.0, port.lns_factor(1)]


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_language_model(lm_bin):
    log = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                  "lnscale_lm_tiny", "--decoder-layers", "2", "--tokens-per-sample", "16", "--max-tokens", "128",
                  *TRAIN_2, "--no-save", "--disable-validation", forked=True).stdout  # fmt: skip
    assert "layernorm-scaling=1/sqrt(l)" in log and re.search(r"num_updates 2\b", log), log[-2000:]
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", log)]
    assert losses and all(math.isfinite(x) for x in losses), log[-2000:]


def incremental_equals_full(model, batch) -> None:
    """Step-by-step decoding with fairseq's incremental state gives the full forward's logits (float64)."""
    enc = model.encoder(batch["src_tokens"], src_lengths=batch["src_lengths"])
    prev = batch["prev_output_tokens"]
    full = model.decoder(prev, encoder_out=enc)[0]
    state: dict = {}
    steps = [
        model.decoder(prev[:, :t], encoder_out=enc, incremental_state=state)[0] for t in range(1, prev.size(1) + 1)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra", [(), ("--decoder-layer-type", "matt"), ("--norm-type", "scalenorm")])
def test_composes_with_sdpa_matt_norms_and_incremental_decoding(extra):
    """``--attention-impl sdpa`` computes the same model; the MAtt decoder's layers carry the factor; step-by-step
    decoding equals the full forward (tolerance: fairseq's float32 softmax, as above)."""
    batch = tiny_batch()
    outs = []
    for impl in ("fairseq", "sdpa"):
        model, _ = build_model("lnscale_iwslt_de_en", *dims(), "--attention-impl", impl, *extra)
        model = model.double().eval()
        assert [lay.input_scale for lay in model.decoder.layers] == [port.lns_factor(i) for i in range(L)]
        with torch.no_grad():
            outs.append(model(**batch)[0])
            incremental_equals_full(model, batch)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
