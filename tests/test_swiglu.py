"""Gated FFNs (``--ffn-type swiglu``, ``swiglu-oss``) against the independent ports of the released code
(``tests/ports/swiglu.py``: gpt-oss's fused ``swiglu``, the paper's SwiGLU): the FFN sub-layer of encoder and
decoder layers, the gate's shape and init, the refused init schemes, the export, fairseq-train. Float64: sums
of a few hundred O(1) terms, compared to 1e-12.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from ports import common
from ports import swiglu as port

from conftest import TINY_DIMS, USER_DIR, build_model, run_cli
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.glu import FFNGate

TOL = dict(rtol=0, atol=1e-12)
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")


def model(*cli: str, arch: str = "preln_iwslt_de_en"):
    m, args = build_model(arch, *TINY_DIMS, *NO_DROPOUT, *cli)
    return m.double().eval(), args


def randomise(m: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if p.dim() == 1 else 2 * p.size(-1) ** -0.5)
            )


def _weights(layer) -> dict:
    d = lambda t: t.detach()  # noqa: E731
    return dict(w_gate=d(layer.ffn_gate.proj.weight), b_gate=d(layer.ffn_gate.proj.bias), w_lin=d(layer.fc1.weight),
                b_lin=d(layer.fc1.bias), w2=d(layer.fc2.weight), b2=d(layer.fc2.bias))  # fmt: skip


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_plain_swiglu_sublayer_equals_the_papers_ffn(stack):
    """Pre-LN FFN sub-layer ``x + SwiGLU(LN(x))``: ``ports.swiglu.swiglu_ffn``; a Swish with beta 1.702 (gpt-oss's
    gate on plain SwiGLU, a mutation) is far off."""
    m, _ = model("--ffn-type", "swiglu")
    layer = getattr(m, stack).layers[1]
    randomise(layer, 2)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ln = layer.final_layer_norm
    with torch.no_grad():
        got = layer._ffn_sublayer(x, x)[0]
        h = common.layer_norm(x, ln.weight.detach(), ln.bias.detach(), ln.eps)
        want = x + port.swiglu_ffn(h, **_weights(layer))
        mutated = x + port.swiglu_ffn(h, **_weights(layer), swish_beta=port.ALPHA)
    torch.testing.assert_close(got, want, **TOL)
    assert (got - mutated).abs().max() > 1e-3


@pytest.mark.parametrize("limit", [port.LIMIT, 0.5], ids=["limit7", "limit0.5"])
def test_gpt_oss_variant_equals_the_released_swiglu(limit):
    """The decoder's FFN sub-layer under ``--ffn-type swiglu-oss``: gpt-oss's ``MLPBlock`` expert with its fused,
    interleaved ``mlp1`` (``ports.swiglu.gpt_oss_mlp``); at limit 0.5 both clamps act. Without the ``+ 1`` (a
    mutation) the port is far off."""
    m, _ = model("--ffn-type", "swiglu-oss", "--swiglu-limit", str(limit))
    layer = m.decoder.layers[0]
    assert isinstance(layer.ffn_gate, FFNGate) and (layer.ffn_gate.limit, layer.ffn_gate.alpha) == (limit, port.ALPHA)
    randomise(layer, 4)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ln = layer.final_layer_norm
    with torch.no_grad():
        got = layer._ffn_sublayer(x, x)[0]
        h = common.layer_norm(x, ln.weight.detach(), ln.bias.detach(), ln.eps)
        want = x + port.gpt_oss_mlp(h, **_weights(layer), limit=limit)
        mutated = x + port.gpt_oss_mlp(h, **_weights(layer), limit=limit, mutate=True)
        fc1 = layer.fc1(h)
    torch.testing.assert_close(got, want, **TOL)
    assert (got - mutated).abs().max() > 1e-3
    if limit < 1:
        assert (fc1.abs() > limit).any() and (layer.ffn_gate.proj(h) > limit).any()  # both clamps act


def test_the_gate_has_the_given_hidden_size_and_each_schemes_init():
    """``W_g`` is ``d -> F`` with F as given (no 2/3 applied behind the user's back): 8d/3 keeps the parameters of a
    4d ReLU FFN; xavier gives it xavier's bound, the 'fairseq' scheme nn.Linear's default like fc1."""
    d, f = 64, 168  # 168 = 8 * 64 / 3 rounded to a multiple of 8
    dims = ("--encoder-ffn-embed-dim", str(f), "--decoder-ffn-embed-dim", str(f))
    m, _ = build_model("preln_iwslt_de_en", *TINY_DIMS, *dims, "--ffn-type", "swiglu")
    relu, _ = build_model("preln_iwslt_de_en", *TINY_DIMS, "--encoder-ffn-embed-dim", "256",
                          "--decoder-ffn-embed-dim", "256")  # fmt: skip
    ffn = lambda layer: [p for n, p in layer.named_parameters() if n.startswith(("fc", "ffn_gate"))]  # noqa: E731
    n_glu = sum(p.numel() for p in ffn(m.encoder.layers[0]))
    n_relu = sum(p.numel() for p in ffn(relu.encoder.layers[0]))
    assert m.encoder.layers[0].ffn_gate.proj.weight.shape == (f, d)
    assert abs(n_glu - n_relu) / n_relu < 0.02, (n_glu, n_relu)
    bound = math.sqrt(6 / (d + f))
    w = m.decoder.layers[1].ffn_gate.proj.weight
    assert 0.9 * bound < w.abs().max() <= bound and not m.decoder.layers[1].ffn_gate.proj.bias.any()
    fs, _ = build_model("preln_iwslt_de_en", *TINY_DIMS, "--ffn-type", "swiglu", "--init-scheme", "fairseq")
    assert fs.decoder.layers[1].ffn_gate.proj.weight.abs().max() <= 1 / math.sqrt(d)  # nn.Linear: U(+-1/sqrt(fan_in))
    assert fs.decoder.layers[1].ffn_gate.proj.bias.abs().max() > 0


BAD = [
    ("tfixup", ("--ffn-type", "swiglu"), "T-Fixup's bound"),
    ("deepnorm", ("--ffn-type", "swiglu-oss"), "DeepNorm's beta"),
    ("dsinit", ("--ffn-type", "swiglu"), "DS-Init's variance argument"),
    ("lipschitz", ("--ffn-type", "swiglu"), "Lipschitz bound"),
    ("subln", ("--ffn-type", "swiglu"), "does not combine with --subln"),
    ("preln", ("--ffn-type", "swiglu", "--activation-fn", "gelu"), "drop --activation-fn"),
    ("preln", ("--ffn-type", "swiglu", "--swiglu-limit", "3"), "only applies to --ffn-type swiglu-oss"),
    ("preln", ("--swiglu-alpha", "1"), "only applies to --ffn-type swiglu-oss"),
    ("preln", ("--ffn-type", "swiglu-oss", "--swiglu-limit", "-1"), "greater than 0"),
]


@pytest.mark.parametrize("family,cli,says", BAD, ids=[f"{f}:{' '.join(c)}" for f, c, _ in BAD])
def test_refusals_are_one_line(family, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(f"{family}_iwslt_de_en", *TINY_DIMS, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("family", ["admin_closed", "postln", "lnscale", "normformer"])
def test_schemes_without_a_two_matrix_constant_build_and_train(family):
    """Admin (its omega measures or counts sub-layers, not matrices), the baselines, LNS's normal-scaled init
    and NormFormer's norm before fc2 take the gate; one backward reaches it."""
    from conftest import tiny_batch

    m, _ = build_model(f"{family}_iwslt_de_en", *TINY_DIMS, "--ffn-type", "swiglu")
    m(**tiny_batch())[0].sum().backward()
    assert m.decoder.layers[1].ffn_gate.proj.weight.grad.abs().sum() > 0


def test_the_export_routes():
    """Plain SwiGLU: stock fairseq refuses it (and so Hugging Face, through it), CTranslate2 carries it (ffn_glu; its
    log-probabilities: tests/test_export.py, family ``swiglu``); gpt-oss's variant: refused by all, in one line."""
    from fairseq_deepinit.export import route

    r = route.classify(model("--ffn-type", "swiglu")[1])
    assert set(r.reasons) == {route.FAIRSEQ, route.HUGGINGFACE} and "no gate" in r.reasons[route.FAIRSEQ]
    assert r.reasons[route.HUGGINGFACE] == r.reasons[route.FAIRSEQ]
    r = route.classify(model("--ffn-type", "swiglu-oss")[1])
    assert all("neither target" in why and "\n" not in why for why in r.reasons.values()), r.reasons


TRAIN = [
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--num-workers", "0",
    "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--disable-validation", "--no-save",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure
def test_fairseq_train_translation_and_language_model(synthetic_bin, lm_bin, tmp_path):
    log = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--ffn-type", "swiglu", "--save-dir", tmp_path, *TRAIN,
                  "--max-update", "3", forked=True).stdout  # fmt: skip
    assert "ffn=swiglu" in log and re.search(r"num_updates 3\b", log), log[-2000:]
    out = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "preln_lm_tiny",
                  "--ffn-type", "swiglu-oss", *TRAIN, "--tokens-per-sample", "32", "--max-update", "3",
                  "--save-dir", tmp_path / "lm", forked=True).stdout  # fmt: skip
    assert "ffn=swiglu-oss(limit=7,alpha=1.702)" in out and re.search(r"num_updates 3\b", out), out[-2000:]
