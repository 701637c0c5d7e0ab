"""Muon with its AdamW fallback as Moonlight releases it (MoonshotAI/Moonlight @ c2ad5b2, ``examples/toy_train.py``):
``zeropower_via_newtonschulz5`` (48-76), ``Muon.adjust_lr_for_muon`` (142-148), ``Muon.step`` (150-239), the split of
``get_optimizer`` (292-304). Written from the released file, not from the plugin: the Newton-Schulz dtype is a
parameter (the release casts to bfloat16, line 61) so that the tests can run it in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def newton_schulz5(G: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``toy_train.py:48-76``."""
    assert len(G.shape) == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(dtype)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class MoonlightMuon:
    """``Muon`` of ``toy_train.py:79-239`` on plain tensors: ``step({name: grad})`` updates ``self.params``."""

    def __init__(self, params: dict, muon_names: set, lr: float, wd: float, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
        self.params = {k: v.clone() for k, v in params.items()}
        self.muon_names, self.lr, self.wd = muon_names, lr, wd
        self.momentum, self.nesterov, self.ns_steps, self.ns_dtype = momentum, nesterov, ns_steps, ns_dtype
        self.betas, self.eps = adamw_betas, adamw_eps
        self.state: dict = {k: {} for k in params}

    def adjust_lr_for_muon(self, lr: float, param_shape) -> float:
        A, B = param_shape[:2]
        return lr * (0.2 * math.sqrt(max(A, B)))

    def step(self, grads: dict) -> None:
        lr = self.lr
        for name in [n for n in self.params if n in self.muon_names]:
            p, g = self.params[name], grads[name]
            if g.ndim > 2:
                g = g.view(g.size(0), -1)
            state = self.state[name]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            buf.mul_(self.momentum).add_(g)
            g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
            u = newton_schulz5(g, self.ns_steps, self.ns_dtype)
            adjusted_lr = self.adjust_lr_for_muon(lr, p.shape)
            p.mul_(1 - lr * self.wd)
            p.add_(u.view_as(p).to(p.dtype), alpha=-adjusted_lr)
        beta1, beta2 = self.betas
        for name in [n for n in self.params if n not in self.muon_names]:
            p, g = self.params[name], grads[name]
            state = self.state[name]
            if "step" not in state:
                state["step"] = 0
                state["moment1"] = torch.zeros_like(g)
                state["moment2"] = torch.zeros_like(g)
            state["step"] += 1
            step = state["step"]
            buf1, buf2 = state["moment1"], state["moment2"]
            buf1.lerp_(g, 1 - beta1)
            buf2.lerp_(g.square(), 1 - beta2)
            g = buf1 / (self.eps + buf2.sqrt())
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            scale = bias_correction1 / bias_correction2**0.5
            p.mul_(1 - lr * self.wd)
            p.add_(g, alpha=-lr / scale)


def moonlight_split(named_params) -> set:
    """The names Muon takes in ``get_optimizer`` (``toy_train.py:293-297``): >= 2-D, not the embedding or head."""
    return {n for n, p in named_params if p.ndim >= 2 and "embed_tokens" not in n and "lm_head" not in n}
