"""Residual modules: the sum that closes every sub-layer, ``skip + branch`` and its scaled forms.

Each sub-layer of each layer owns one :class:`Residual` module (``layer.residuals[<sub-layer>]``); the
layer's forward calls it with the (dropped-out) ``branch`` output and the sub-layer's ``skip`` input
(:func:`~fairseq_deepinit.modules.sublayer.sublayer_output`). Because it is a module of its
own, forward hooks on it see exactly the two tensors the papers' statistics are about (Admin
profiling, diagnostics). Which module a sub-layer gets is the residual scaling's (``--residual-scale``, a
:class:`~fairseq_deepinit.methods.record.ResidualScaling` of a method's record); the modules here are the
plain building blocks:

- :class:`Residual`: ``skip + branch`` (Vaswani et al. 2017);
- :class:`ConstantResidual`: ``alpha * skip + branch`` with a constant alpha (DeepNorm, Wang et al.
  2022, eq. (2));
- :class:`ReZeroResidual`: ``skip + a * branch`` with one learned scalar ``a`` starting at 0
  (Bachlechner et al. 2020, eq. (5));
- :class:`AdminResidual`: ``skip * omega + branch`` with a learned vector omega that profiling sets
  before the first update (Liu et al. 2020, sec. 4.3; :mod:`fairseq_deepinit.admin`);
- :class:`BranchScaleResidual`: ``skip + m * branch`` with a constant branch multiplier m (depth-muP,
  Yang et al. 2023, and CompleteP, Dey et al. 2025: ``m = (L / L_base)^-alpha``, :func:`depth_branch_multiplier`);
- :class:`B2TResidual`: the plain sum, plus the layer's input on the layer's last sub-layer (Takase et
  al. 2022, eq. (5)-(6); released code takase/b2t_connection @ c8e2ad4,
  fairseq/modules/transformer_layer.py:104-105 and 136-141 (encoder), 278-279 and 368-373 (decoder)).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

from ..errors import AdminNotProfiledError


class Residual(nn.Module):
    """``skip + branch``.

    Subclasses scale either term by overriding :meth:`scaled_skip` (the scaled sub-layer input) or
    :meth:`forward`; :mod:`fairseq_deepinit.diagnostics.hooks` reads :meth:`scaled_skip` to measure the skip
    path. ``reads_layer_input``: the layer passes its own input as a third argument (B2T).
    """

    reads_layer_input = False

    def enter(self, x: torch.Tensor):
        """``(branch input, skip)`` of the sub-layer whose input is ``x``: ``(x, x)`` here; a residual on several
        streams (:mod:`.hyper`) reads the branch input out of them and hands its skip to :meth:`forward`."""
        return x, x

    def scaled_skip(self, skip: torch.Tensor) -> torch.Tensor:
        """The skip term as it enters the sum (``skip`` scaled as this module does)."""
        return skip

    def forward(self, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        # branch first: the sum takes the layout of its first operand, and the branch output is
        # contiguous while fairseq's residual stream starts as a transposed (T, B, C) view; a
        # contiguous stream keeps every later Linear on the addmm fast path (same values: + commutes)
        return branch + self.scaled_skip(skip)


class ConstantResidual(Residual):
    """``alpha * skip + branch`` with a constant (not learned) ``alpha`` (DeepNorm, Wang et al. 2022, eq. 2).

    One ``torch.add(branch, skip, alpha=alpha)``: one kernel each way, and one rounding where ``branch + skip *
    alpha`` has two (the bound, checked by ``tests/test_kernels.py``: docs/speed.md, "Kernels per norm and per
    residual").
    """

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = float(alpha)

    def scaled_skip(self, skip: torch.Tensor) -> torch.Tensor:
        return skip * self.alpha

    def forward(self, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        # branch first, as Residual.forward: the sum takes x's (contiguous) layout
        return torch.add(branch, skip, alpha=self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}"


def depth_branch_multiplier(layers: int, base_layers: int, alpha: float) -> float:
    """``(L / L_base) ** -alpha``: the residual-branch multiplier of depth-muP (alpha 1/2, Yang et al. 2023,
    Tensor Programs VI) and CompleteP (alpha 1, Dey et al. 2025, Table 1); EleutherAI/nanoGPT-mup @ 6f8bc3b
    (branch ``completep``) ``model.py:113`` (``residual_scaling``), Megatron-LM PR 4999
    ``residual_branch_multiplier``."""
    return (layers / base_layers) ** -alpha


class BranchScaleResidual(Residual):
    """``skip + m * branch`` with a constant ``m`` (depth-muP / CompleteP; nanoGPT-mup ``model.py:117-118``:
    ``x = x + self.residual_scaling * self.attn(self.ln_1(x))``).

    One ``torch.add(skip, branch, alpha=m)``: the multiplier rides on the add (one kernel forward, one
    backward for the ``m *`` of the branch's gradient), as :class:`ConstantResidual` does on the skip. The
    sum takes the layout of its first operand, here the skip; where the skip is still fairseq's transposed
    (T, B, C) view of the embedding (a stack's first sub-layer) it is made contiguous first (one copy per
    stack), so that the stream and every later Linear stay on the contiguous fast path (``Residual.forward``).
    Same value as ``skip + m * branch`` up to one rounding, as :class:`ConstantResidual`.
    """

    def __init__(self, multiplier: float) -> None:
        super().__init__()
        self.multiplier = float(multiplier)

    def forward(self, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.add(skip.contiguous(), branch, alpha=self.multiplier)

    def extra_repr(self) -> str:
        return f"multiplier={self.multiplier:.6g}"


class ReZeroResidual(Residual):
    """``skip + a * branch``, ``a`` a learned scalar starting at 0 (ReZero, eq. 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.alpha * branch + skip  # branch first: contiguous output, see Residual.forward


class LayerInputResidual(Residual):
    """A residual that also reads the layer's input (the layer passes it as a third argument)."""

    reads_layer_input = True

    def forward(self, branch: torch.Tensor, skip: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class B2TResidual(LayerInputResidual):
    """B2T connection: ``branch + skip``, and on the layer's last sub-layer ``+ layer_input`` too.

    The sums are in the released code's order (transformer_layer.py:136,141: ``x = residual + x``,
    then ``x = residual_bottom + x``), so outputs match it bit for bit.
    """

    def __init__(self, top: bool) -> None:
        super().__init__()
        self.top = top

    def forward(self, branch: torch.Tensor, skip: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        out = branch + skip
        return out + layer_input if self.top else out

    def extra_repr(self) -> str:
        return f"top={self.top}"


class AdminResidual(Residual):
    """``x_{i-1} * omega + f_i(x_{i-1})`` with ``omega`` a learned vector of size d starting at 1.

    ``profiled`` (a buffer, so it travels in checkpoints) records whether omega was set by profiling
    or from a profile file. fairseq's training step calls ``set_num_updates`` on every module before
    its forward; a training-mode forward after that with omega never profiled is an error (the model
    would silently train as Post-LN with omega = 1, e.g. under ``--task translation``).

    The host keeps a copy of the flag (:meth:`is_profiled`), so that no training step reads the
    buffer back from the device: set by :meth:`mark_profiled` and by loading a state dict, kept
    across ``.to()``, and valid while the buffer's version counter (bumped by any in-place write)
    is the one it was taken at; after any other write the buffer is read once.
    """

    def __init__(self, dim: int, trainable: bool = True) -> None:
        super().__init__()
        self.omega = nn.Parameter(torch.ones(dim), requires_grad=trainable)
        self.register_buffer("profiled", torch.zeros((), dtype=torch.uint8))
        self._remember(False)
        self._in_fairseq_training = False
        self._profiling = False

    def _remember(self, flag: bool) -> None:
        self.host_profiled = flag  # the host's copy of ``profiled`` ...
        self._host_version = self.profiled._version  # ... taken at this version of the buffer

    def is_profiled(self) -> bool:
        """The ``profiled`` flag, from the host's copy while it is current (otherwise read once)."""
        if self._host_version != self.profiled._version:
            self._remember(bool(self.profiled))
        return self.host_profiled

    def mark_profiled(self) -> None:
        """Record that omega is set (by profiling, a profile file or the closed form)."""
        with torch.no_grad():
            self.profiled.fill_(1)
        self._remember(True)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # a checkpoint's flag (fairseq loads checkpoints on the CPU: reading it waits for no device)
        flag = state_dict.get(prefix + "profiled")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if flag is not None:
            self._remember(bool(flag))

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .to_empty() make a new buffer (a new version counter): the flag is the same
        current = self._host_version == self.profiled._version
        out = super()._apply(fn, *args, **kwargs)
        if current:
            self._remember(self.host_profiled)
        return out

    def scaled_skip(self, skip: torch.Tensor) -> torch.Tensor:
        return skip * self.omega

    def set_num_updates(self, num_updates: int) -> None:
        self._in_fairseq_training = True

    def forward(self, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        # a plain attribute first: once profiled, the check reads no tensor state (nor does torch.compile)
        if (
            self.training
            and self._in_fairseq_training
            and not (self._profiling or self.host_profiled or self.is_profiled())
        ):
            raise AdminNotProfiledError(
                "Admin's omega was never profiled, so this would train plain Post-LN with omega = 1. "
                "Train with --task translation_admin (language_modeling_admin for a language model; it "
                "profiles before the first update), or load a profile with --admin-profile-path under that task."
            )
        return super().forward(branch, skip)

    def extra_repr(self) -> str:
        return f"dim={self.omega.numel()}, trainable={self.omega.requires_grad}"


def residual_modules(model: nn.Module) -> OrderedDict[str, Residual]:
    """Every residual module of ``model`` by name (``encoder.layers.0.residuals.self_attn``), module order."""
    return OrderedDict((name, m) for name, m in model.named_modules() if isinstance(m, Residual))


def sublayer_name(module_name: str) -> str:
    """``encoder.layers.3.residuals.ffn`` -> ``encoder.layers.3.ffn`` (wrappers' prefixes dropped)."""
    return module_name.replace("._checkpoint_wrapped_module", "").replace(".residuals.", ".")
