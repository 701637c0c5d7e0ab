"""Mix-LN (``fairseq_deepinit/methods/mixln.py``) against the independent port of its released code
(``tests/ports/mix_ln.py``: pixeli99/MixLN modeling_llama.py:325-333, 565-601).

- the per-layer placement pattern: k = floor(0.25 L) Post-LN layers per stack at the released depths and
  this project's (``port.num_post_layers``, ``port.layer_kinds``), ``--mixln-ratio`` and
  ``--mixln-post-layers``;
- the models' outputs with identical weights (a translation model, the split in both stacks, and a
  decoder-only LM, both with the stack's final norm as released), LayerNorm and RMSNorm, float64 and
  float32;
- the refusals (one line); aten ops of a training update within 2 % of stock fairseq's Pre-LN;
- fairseq-train for translation (saved, reloaded by fairseq's loader) and for an LM.

Tolerances as in tests/test_lnscale.py (same layers, same float path): float64 1e-6 for translation
(fairseq's cross-attention softmax runs in float32, ``fairseq/utils.py:518``), 1e-12 for the LM;
float32 against the float64 port ``4 L sum(n) u``. A layer given the other placement, or a missing final
norm, moves the outputs by O(1).
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from ports import mix_ln as port
from ports.common import AttnWeights, FFNWeights, NormSpec, decoder_input, lm_layers
from test_lm import build_lm as lm_build

from conftest import TRAIN_2, USER_DIR, build_model, perturb_norms, run_cli, tiny_batch, train_and_reload
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.methods.mixln import num_post_layers

D, FF, H, L, K = 16, 32, 2, 4, 2
U32 = 2.0**-24
TOL32 = 4 * L * (3 * D + D // H + 7 + D + D + FF) * U32


def dims(layers=(L, L), d: int = D) -> list:
    return [
        "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
        "--encoder-ffn-embed-dim", str(FF), "--decoder-ffn-embed-dim", str(FF),
        "--encoder-attention-heads", str(H), "--decoder-attention-heads", str(H),
        "--encoder-layers", str(layers[0]), "--decoder-layers", str(layers[1]), "--dropout", "0",
    ]  # fmt: skip


def build_lm(*cli: str):
    """``(model, args)`` of ``mixln_lm_tiny`` built as fairseq-train builds it (tests/test_lm.py)."""
    model, args, _ = lm_build("mixln_lm_tiny", *cli)
    return model, args


@pytest.mark.parametrize("layers", [6, 12, 18, 24, 48])
def test_post_layers_at_the_released_ratio(layers):
    """floor(0.25 L): 3 of 12 and 6 of 24 (the released scripts), 1 of 6, 4 of 18, 12 of 48; per stack and
    for a decoder-only stack; ``--mixln-post-layers`` overrides the ratio."""
    cfg = SimpleNamespace(mix_ln=True, mixln_ratio=0.25, mixln_post_layers=None,
                          encoder=SimpleNamespace(layers=layers), decoder=SimpleNamespace(layers=layers))  # fmt: skip
    from fairseq_deepinit.methods.mixln import layer_placements

    assert num_post_layers(cfg, layers) == port.num_post_layers(layers)
    got = list(layer_placements(cfg, layers))
    assert got == port.layer_kinds(layers, port.num_post_layers(layers))
    cfg.mixln_post_layers = 2
    assert list(layer_placements(cfg, layers)) == port.layer_kinds(layers, 2)


def test_built_models_place_the_norms_per_layer():
    model, _ = build_model("mixln_iwslt_de_en", *dims((8, 4)))
    assert [lay.placement for lay in model.encoder.layers] == port.layer_kinds(8, 2)
    assert [lay.placement for lay in model.decoder.layers] == port.layer_kinds(4, 1)
    assert model.encoder.layer_norm is not None and model.decoder.layer_norm is not None  # as released
    model, _ = build_model("mixln_iwslt_de_en", *dims((8, 4)), "--mixln-ratio", "0.5")
    assert [lay.placement for lay in model.decoder.layers] == port.layer_kinds(4, 2)
    lm, _ = build_lm("--decoder-layers", "12")
    assert [lay.placement for lay in lm.decoder.layers] == port.layer_kinds(12, 3)
    assert lm.decoder.layer_norm is not None


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_translation_model_equals_the_port(norm, dtype):
    model, _ = build_model("mixln_iwslt_de_en", *dims(), "--mixln-post-layers", str(K), "--norm-type", norm)
    model = model.to(dtype).eval()
    perturb_norms(model)
    b = tiny_batch()
    with torch.no_grad():
        enc = model.encoder(b["src_tokens"], src_lengths=b["src_lengths"])
        got = (enc["encoder_out"][0].transpose(0, 1), model.decoder(b["prev_output_tokens"], encoder_out=enc,
                                                                    features_only=True)[0])  # fmt: skip
        m = model.double()
        n = NormSpec.from_module
        kinds = port.layer_kinds(L, K)
        x = m.encoder.forward_embedding(b["src_tokens"])[0]
        for kind, lay in zip(kinds, m.encoder.layers, strict=True):
            norms = {"attn": n(lay.self_attn_layer_norm), "ffn": n(lay.final_layer_norm)}
            x = port.translation_layer(x, kind, None, AttnWeights.from_module(lay.self_attn), None,
                                       FFNWeights.from_module(lay), norms, H, causal=False)  # fmt: skip
        memory = n(m.encoder.layer_norm)(x)
        y = decoder_input(m.decoder, b["prev_output_tokens"])
        for kind, lay in zip(kinds, m.decoder.layers, strict=True):
            norms = {"attn": n(lay.self_attn_layer_norm), "cross": n(lay.encoder_attn_layer_norm),
                     "ffn": n(lay.final_layer_norm)}  # fmt: skip
            y = port.translation_layer(y, kind, memory, AttnWeights.from_module(lay.self_attn),
                                       AttnWeights.from_module(lay.encoder_attn), FFNWeights.from_module(lay),
                                       norms, H, causal=True)  # fmt: skip
        want = (memory, n(m.decoder.layer_norm)(y))
    tol = 1e-6 if dtype == torch.float64 else TOL32
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_language_model_equals_the_port(dtype):
    model, _ = build_lm("--decoder-layers", str(L), "--decoder-embed-dim", str(D), "--decoder-ffn-embed-dim",
                        str(FF), "--decoder-attention-heads", str(H), "--dropout", "0", "--mixln-post-layers",
                        str(K))  # fmt: skip
    model = model.to(dtype).eval()
    perturb_norms(model)
    tokens = tiny_batch()["prev_output_tokens"]
    with torch.no_grad():
        got, _ = model.decoder(tokens, features_only=True)
        dec = model.double().decoder
        want = port.lm_stack(decoder_input(dec, tokens), lm_layers(dec), K, H, NormSpec.from_module(dec.layer_norm))
    tol = 1e-12 if dtype == torch.float64 else TOL32
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


BAD = [
    (("deepinit_tiny", "--mix-ln"), "--encoder-normalize-before --decoder-normalize-before"),
    (("mixln_iwslt_de_en", "--norm-type", "none"), "--norm-type none"),
    (("mixln_iwslt_de_en", "--mixln-post-layers", "3"), "more than the decoder's 2 layers"),
    (("mixln_iwslt_de_en", "--mixln-ratio", "1.5"), "--mixln-ratio must be in [0, 1]"),
    (("mixln_iwslt_de_en", "--mixln-post-layers", "-1"), "--mixln-post-layers must be >= 0"),
    (("deepinit_tiny", "--mixln-post-layers", "1"), "needs --mix-ln"),
    (("mixln_iwslt_de_en", "--residual-scale", "rezero"), "drop --residual-scale rezero"),
]


@pytest.mark.parametrize("cli,says", BAD, ids=[" ".join(c) for c, _ in BAD])
def test_refusals_are_one_line(cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(cli[0], *dims((2, 2)), *cli[1:])
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["mt", "lm"])
def test_update_ops_within_2_percent_of_stock(kind):
    """One training update of the 4-layer family (k = 1 per stack) against stock fairseq Pre-LN: the same
    operations in another order, at most 1.02x stock's aten ops."""
    from deepinit_tools.bench import gpu_readiness as gr
    from deepinit_tools.bench.readiness_build import update_ops
    from deepinit_tools.harness.fairseq_train import Shape

    gr.plugin()
    shape = Shape(4, 16, 32, 2)
    plugin, b = update_ops(kind, gr.Family(kind, "mixln").arch, shape)
    assert [lay.placement for lay in b.model.decoder.layers] == port.layer_kinds(4, 1)
    stock, _ = update_ops(kind, gr.stock_arch(kind), shape, *gr.stock_flags(b))
    assert plugin.total <= 1.02 * stock.total, (plugin.total, stock.total, plugin.total / stock.total)


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_translation_saves_and_reloads(synthetic_bin, tmp_path):
    log, model = train_and_reload(synthetic_bin, tmp_path, "--arch", "mixln_iwslt_de_en", *dims())
    assert "mix-ln=post ratio 0.25" in log and re.search(r"num_updates 2\b", log), log[-2000:]
    assert [lay.placement for lay in model.encoder.layers] == port.layer_kinds(L, 1)


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_fairseq_train_language_model(lm_bin):
    log = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                  "mixln_lm_tiny", "--decoder-layers", "4", "--tokens-per-sample", "16", "--max-tokens", "128",
                  *TRAIN_2, "--no-save", "--disable-validation", forked=True).stdout  # fmt: skip
    assert "mix-ln=post ratio 0.25" in log and re.search(r"num_updates 2\b", log), log[-2000:]
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", log)]
    assert losses and all(math.isfinite(x) for x in losses), log[-2000:]


@pytest.mark.parametrize("extra", [(), ("--decoder-layer-type", "matt"), ("--norm-type", "scalenorm")])
def test_composes_with_sdpa_matt_norms_and_incremental_decoding(extra):
    """``--attention-impl sdpa`` computes the same model; the MAtt decoder's layers take the placement;
    step-by-step decoding equals the full forward (float64; fairseq's float32 softmax bounds the difference)."""
    batch = tiny_batch()
    outs = []
    for impl in ("fairseq", "sdpa"):
        model, _ = build_model("mixln_iwslt_de_en", *dims(), "--mixln-post-layers", str(K), "--attention-impl", impl,
                               *extra)  # fmt: skip
        model = model.double().eval()
        assert [lay.placement for lay in model.decoder.layers] == port.layer_kinds(L, K)
        with torch.no_grad():
            outs.append(model(**batch)[0])
            enc = model.encoder(batch["src_tokens"], src_lengths=batch["src_lengths"])
            prev = batch["prev_output_tokens"]
            full = model.decoder(prev, encoder_out=enc)[0]
            state: dict = {}
            steps = [model.decoder(prev[:, :t], encoder_out=enc, incremental_state=state)[0]
                     for t in range(1, prev.size(1) + 1)]  # fmt: skip
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
