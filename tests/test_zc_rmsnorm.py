"""Zero-centred RMSNorm (``--norm-type zc-rmsnorm``) against the independent port of Qwen3-Next's released norm
(``tests/ports/zc_rmsnorm.py``): the module in float64, float32 and bfloat16, its start (``w = 0``: the plain
RMSNorm of gain 1), every norm of a model under every placement, weight decay on ``w`` with fairseq's Adam, the
CTranslate2 route, fairseq-train. Tolerances: float64 to 1e-12 (O(1) values); float32 and bfloat16 input: the
plugin (one ``F.rms_norm`` in float32) and the port (its own float32 products) round differently inside float32,
then both round once to the input's dtype, so they agree to one ulp of the output's dtype.
"""

from __future__ import annotations

import re

import pytest
import torch
from ports import zc_rmsnorm as port

from conftest import TINY_DIMS, USER_DIR, build_model, run_cli
from fairseq_deepinit.modules.norms import RMSNorm, ZeroCentredRMSNorm, build_norm, is_norm


def _x(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 3, 32, generator=g, dtype=torch.float64) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_the_norm_is_qwen3_nexts(dtype):
    """The module, weights and input in ``dtype``, against ``Qwen3NextRMSNorm.forward``; a plain gain ``w`` (the
    RMSNorm's, a mutation) is far off."""
    norm = build_norm("zc-rmsnorm", 32, eps=1e-6)
    assert isinstance(norm, ZeroCentredRMSNorm) and is_norm(norm) and not norm.weight.any()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=torch.Generator().manual_seed(1)) * 0.5)
    norm = norm.to(dtype)
    x = _x(dtype)
    with torch.no_grad():
        got, want = norm(x), port.zc_rms_norm(x, norm.weight, 1e-6)
        mutated = port.zc_rms_norm(x, norm.weight, 1e-6, mutate=True)
    assert got.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    else:
        ulp = torch.finfo(dtype).eps * want.abs().float().clamp(min=torch.finfo(dtype).tiny)
        assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got.double() - mutated.double()).abs().max() > 0.1


def test_at_init_it_is_the_plain_rmsnorm_and_its_gradient_reaches_w():
    zc, plain = ZeroCentredRMSNorm(32, eps=1e-6).double(), RMSNorm(32, eps=1e-6).double()
    x = _x(torch.float64, 2).requires_grad_()
    torch.testing.assert_close(zc(x), plain(x), rtol=0, atol=1e-15)
    zc(x).pow(2).sum().backward()
    assert zc.weight.grad.abs().min() > 0


PLACEMENTS = {
    "post": (),
    "pre": ("--norm-placement", "pre"),
    "peri": ("--norm-placement", "peri"),
    "reordered": ("--norm-placement", "reordered"),
    "pre+embedding": ("--norm-placement", "pre", "--layernorm-embedding"),
}


@pytest.mark.parametrize("placement", PLACEMENTS, ids=list(PLACEMENTS))
def test_every_norm_of_every_placement_is_zero_centred(placement):
    """Every norm the model holds (sub-layer, Peri-LN's output norms, final, embedding) is a zero-centred RMSNorm
    with ``w = 0``, so the built model is, at init, the plain RMSNorm model; one backward reaches each ``w``."""
    from conftest import tiny_batch

    m, _ = build_model("deepinit_tiny", *TINY_DIMS, "--norm-type", "zc-rmsnorm", *PLACEMENTS[placement])
    plain, _ = build_model("deepinit_tiny", *TINY_DIMS, "--norm-type", "rmsnorm", *PLACEMENTS[placement])
    norms = [mod for mod in m.modules() if is_norm(mod)]
    assert norms and all(isinstance(n, ZeroCentredRMSNorm) and not n.weight.any() for n in norms)
    assert len(norms) == len([mod for mod in plain.modules() if is_norm(mod)])
    ones = {k: v for k, v in plain.state_dict().items() if "norm" in k}  # the plain RMSNorms' gains: 1
    plain.load_state_dict({**m.state_dict(), **ones})
    b = tiny_batch()
    m.eval(), plain.eval()
    torch.testing.assert_close(m(**b)[0], plain(**b)[0], rtol=0, atol=1e-5)
    m.train()
    m(**b)[0].sum().backward()
    assert all(n.weight.grad is not None for n in norms)


def test_fairseq_adam_weight_decay_pulls_w_and_the_gain_towards_the_identity():
    """fairseq's Adam applies ``--weight-decay`` to every parameter (no norm exclusion), ``w`` included:
    ``w <- w (1 - lr wd)`` with a zero gradient, so the gain ``1 + w`` decays towards 1, not towards 0."""
    from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig

    norm = ZeroCentredRMSNorm(8)
    with torch.no_grad():
        norm.weight.fill_(0.5)
    opt = FairseqAdam(FairseqAdamConfig(lr=[0.1], weight_decay=0.2), list(norm.parameters()))
    norm.weight.grad = torch.zeros(8)
    opt.step()
    torch.testing.assert_close(norm.weight.detach(), torch.full((8,), 0.5 * (1 - 0.1 * 0.2)), rtol=0, atol=1e-7)


def test_ctranslate2_carries_it_as_an_rmsnorm_of_gain_one_plus_w():
    """The route: CTranslate2 exact (the fold step writes ``1 + w``), stock fairseq refused in one line."""
    from fairseq_deepinit.export import fold, route

    m, args = build_model("preln_iwslt_de_en", *TINY_DIMS, "--norm-type", "zc-rmsnorm")
    r = route.classify(args)
    assert route.CTRANSLATE2 not in r.reasons and "zero-centred-gain" in r.steps and r.ct2_eps == 1e-5
    assert "zc-rmsnorm" in r.reasons[route.FAIRSEQ] and "\n" not in r.reasons[route.FAIRSEQ]
    with torch.no_grad():
        m.decoder.layers[0].final_layer_norm.weight.fill_(0.25)
    sd, _ = fold.plain_state_dict(m.double(), args, r)
    assert (sd["decoder.layers.0.final_layer_norm.weight"] == 1.25).all()
    assert (sd["encoder.layers.0.final_layer_norm.weight"] == 1.0).all()


TRAIN = [
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--num-workers", "0", "--weight-decay",
    "0.01", "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--disable-validation", "--no-save",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure
def test_fairseq_train_translation_and_language_model(synthetic_bin, lm_bin, tmp_path):
    log = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--norm-type", "zc-rmsnorm", "--save-dir", tmp_path,
                  *TRAIN, "--max-update", "3", forked=True).stdout  # fmt: skip
    assert "norm=zc-rmsnorm" in log and re.search(r"num_updates 3\b", log), log[-2000:]
    out = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "preln_lm_tiny",
                  "--norm-type", "zc-rmsnorm", *TRAIN, "--tokens-per-sample", "32", "--max-update", "3",
                  "--save-dir", tmp_path / "lm", forked=True).stdout  # fmt: skip
    assert "norm=zc-rmsnorm" in out and re.search(r"num_updates 3\b", out), out[-2000:]
