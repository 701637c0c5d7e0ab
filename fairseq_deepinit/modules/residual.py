"""Residual scaling, one axis of the model (``--residual-scale``).

Each sub-layer of each layer owns one :class:`Residual` module; fairseq's
``residual_connection(x, residual)`` hook calls it with the (dropped-out) branch output ``x`` and
the sub-layer input ``residual``. Because it is a module of its own, forward hooks on it see
exactly the two tensors the papers' statistics are about (Admin profiling, diagnostics).

- ``none``: ``residual + x`` (Vaswani et al. 2017).
- ``deepnorm``: ``alpha * residual + x`` (Wang et al. 2022, DeepNet eq. (2), Table 1: alpha_enc =
  0.81 (N^4 M)^(1/16), alpha_dec = (3M)^(1/4) in an encoder-decoder model, (2M)^(1/4) decoder-only;
  the layer's :class:`~.stacks.StackKind` picks the row).
- ``rezero``: ``residual + a * x`` with one learned scalar ``a`` per sub-layer initialised to 0
  (Bachlechner et al. 2020, eq. (5); the Admin paper's Table 3 baseline).
- ``b2t``: B2T connection (Takase et al. 2022, eq. (5)-(6)): plain residuals, plus the layer's input
  added before the layer's last norm, ``LN(x_l + h + FFN(h))`` with ``h`` the output of the layer's
  earlier sub-layers (released code: takase/b2t_connection @ c8e2ad4,
  fairseq/modules/transformer_layer.py:104-105 and 136-141 (encoder), 278-279 and 368-373 (decoder)).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn as nn

from .stacks import DECODER, DECODER_ONLY, ENCODER, StackKind

RESIDUAL_SCALES = ("none", "deepnorm", "rezero", "b2t")


class Residual(nn.Module):
    """``residual + x``.

    Subclasses scale either term by overriding :meth:`skip` (the scaled sub-layer input) or
    :meth:`forward`; :mod:`fairseq_deepinit.hooks` reads :meth:`skip` to measure the skip path.
    """

    def skip(self, residual: torch.Tensor) -> torch.Tensor:
        """The skip-path term as it enters the sum (``residual`` scaled as this module does)."""
        return residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # branch first: the sum takes the layout of its first operand, and the branch output is
        # contiguous while fairseq's residual stream starts as a transposed (T, B, C) view; a
        # contiguous stream keeps every later Linear on the addmm fast path (same values: + commutes)
        return x + self.skip(residual)


class ConstantResidual(Residual):
    """``alpha * residual + x`` with a constant (not learned) ``alpha`` (DeepNorm).

    One ``torch.add(x, residual, alpha=alpha)``: one kernel forward and one backward (the ``alpha *``
    of the skip's gradient), where ``x + residual * alpha`` takes two forward (a separate ``mul``) and
    one backward. Same value up to rounding: the fused add rounds ``x + alpha * residual`` once (an
    FMA on vectorised CPU paths; in fp32 opmath for fp16/bf16), the two-kernel form rounds the product
    first; and a kernel may round ``alpha`` itself to a 16-bit operand's dtype (torch's CPU kernel does:
    a relative change of the skip scale of at most ``u``; in fp32, and with an fp32 operand as under
    autocast, ``alpha`` is an fp32 number either way). With ``u`` the unit round-off of the dtype, the
    two forms differ by at most ``2u (|alpha * residual| + |x + alpha * residual|)`` per element to
    first order (``tests/test_kernels.py`` checks it on every CPU kernel path; the scalar fp32 path,
    without FMA, is bit-identical).
    """

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = float(alpha)

    def skip(self, residual: torch.Tensor) -> torch.Tensor:
        return residual * self.alpha

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # branch first, as Residual.forward: the sum takes x's (contiguous) layout
        return torch.add(x, residual, alpha=self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}"


class ReZeroResidual(Residual):
    """``residual + a * x``, ``a`` a learned scalar starting at 0 (ReZero, eq. 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.alpha * x + residual  # branch first: contiguous output, see Residual.forward


class LayerInputResidual(Residual):
    """A residual that also reads the layer's input (the layer passes it as a third argument)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class B2TResidual(LayerInputResidual):
    """B2T connection: ``x + residual``, and on the layer's last sub-layer ``+ layer_input`` too.

    The sums are in the released code's order (transformer_layer.py:136,141: ``x = residual + x``,
    then ``x = residual_bottom + x``), so outputs match it bit for bit.
    """

    def __init__(self, top: bool) -> None:
        super().__init__()
        self.top = top

    def forward(self, x: torch.Tensor, residual: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        out = x + residual
        return out + layer_input if self.top else out

    def extra_repr(self) -> str:
        return f"top={self.top}"


def deepnorm_alpha(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """DeepNet (Wang et al. 2022) Table 1: the residual alpha of a layer of ``kind``.

    Encoder-decoder: alpha_enc = 0.81 (N^4 M)^(1/16), alpha_dec = (3M)^(1/4); decoder-only:
    (2M)^(1/4) (torchscale @ 4d1e0e8, architecture/encoder.py:78-87, decoder.py:89-93).
    """
    n, m = encoder_layers, decoder_layers
    if kind == ENCODER:
        return 0.81 * (n**4 * m) ** (1.0 / 16)
    if kind == DECODER:
        return (3.0 * m) ** 0.25
    if kind == DECODER_ONLY:
        return (2.0 * m) ** 0.25
    raise ValueError(f"DeepNorm has no constants for a {kind} layer")


def deepnorm_beta(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """DeepNet (Wang et al. 2022) Table 1: the init gain beta of a layer of ``kind``.

    Encoder-decoder: beta_enc = 0.87 (N^4 M)^(-1/16), beta_dec = (12M)^(-1/4); decoder-only:
    (8M)^(-1/4).
    """
    n, m = encoder_layers, decoder_layers
    if kind == ENCODER:
        return 0.87 * (n**4 * m) ** (-1.0 / 16)
    if kind == DECODER:
        return (12.0 * m) ** -0.25
    if kind == DECODER_ONLY:
        return (8.0 * m) ** -0.25
    raise ValueError(f"DeepNorm has no constants for a {kind} layer")


ResidualBuilder = Callable[[object, StackKind, str, int], Residual]

# name -> builder(cfg, kind of the layer, sublayer, layer_idx); other modules (Admin) register here too
RESIDUAL_BUILDERS: Dict[str, ResidualBuilder] = {
    "none": lambda cfg, kind, sub, idx: Residual(),
    "deepnorm": lambda cfg, kind, sub, idx: ConstantResidual(
        deepnorm_alpha(kind, cfg.encoder.layers, cfg.decoder.layers)
    ),
    "rezero": lambda cfg, kind, sub, idx: ReZeroResidual(),
    # the FFN is the last sub-layer of every encoder and decoder layer
    "b2t": lambda cfg, kind, sub, idx: B2TResidual(top=sub == "ffn"),
}


def register_residual(name: str, builder: ResidualBuilder) -> None:
    if name in RESIDUAL_BUILDERS:
        raise ValueError(f"residual scale {name!r} is already registered")
    RESIDUAL_BUILDERS[name] = builder


def build_residuals(cfg, kind: StackKind, sublayers: tuple, layer_idx: int) -> nn.ModuleDict:
    """One residual module per sub-layer name of a layer of ``kind``, for ``cfg.residual_scale``."""
    builder = RESIDUAL_BUILDERS[cfg.residual_scale]
    return nn.ModuleDict({name: builder(cfg, kind, name, layer_idx) for name in sublayers})
