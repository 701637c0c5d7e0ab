"""``--optimizer radam`` (fairseq_deepinit/radam.py) against RAdam written out by hand (Liu et al.
2020, "On the Variance of the Adaptive Learning Rate and Beyond", Algorithm 2, decoupled weight decay)."""

from __future__ import annotations

import math

import pytest


def radam_by_hand(p: float, grads: list[float], lr: float, b1: float, b2: float, eps: float, wd: float) -> list[float]:
    m = v = 0.0
    rho_inf = 2 / (1 - b2) - 1
    out = []
    for t, g in enumerate(grads, start=1):
        p *= 1 - lr * wd  # decoupled weight decay, as the released fairseq RAdam and fairseq's adam
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        rho_t = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho_t > 5:  # variance is tractable: rectified adaptive step
            r = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            p -= lr * r * m_hat * math.sqrt(1 - b2**t) / (math.sqrt(v) + eps)
        else:  # first updates: un-adapted momentum (the released code's degenerated_to_sgd)
            p -= lr * m_hat
        out.append(p)
    return out


def test_radam_matches_the_algorithm_by_hand():
    import torch

    import fairseq_deepinit  # noqa: F401  (registers the optimizer)
    from fairseq_deepinit.training.radam import FairseqRAdam, FairseqRAdamConfig

    lr, wd, grads = 0.01, 0.1, [0.5, -1.0, 2.0, 0.3, 0.3, -0.7, 1.1, 0.2, -0.4, 0.9]
    param = torch.nn.Parameter(torch.tensor([1.5], dtype=torch.float64))
    cfg = FairseqRAdamConfig(adam_betas="(0.9, 0.98)", adam_eps=1e-8, weight_decay=wd, lr=[lr])
    opt = FairseqRAdam(cfg, [param])
    got = []
    for g in grads:
        param.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        got.append(param.item())
    # with beta2 = 0.98, rho_t > 5 from t = 6 on: both branches are exercised
    assert got == pytest.approx(radam_by_hand(1.5, grads, lr, 0.9, 0.98, 1e-8, wd), rel=1e-9, abs=1e-12)


def test_radam_is_selectable_from_the_command_line():
    from fairseq import options
    from fairseq.optim import OPTIMIZER_REGISTRY

    from conftest import USER_DIR

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        ["/nonexistent", "--user-dir", USER_DIR, "--arch", "admin_iwslt_de_en", "--optimizer", "radam",
         "--adam-betas", "(0.9,0.98)", "--weight-decay", "0.0001", "--lr", "7e-4"],
    )  # fmt: skip
    assert args.optimizer == "radam" and "radam" in OPTIMIZER_REGISTRY
    assert (args.adam_betas, args.weight_decay) == ("(0.9,0.98)", 0.0001)
