"""QK-Clip after each optimizer step (``--qk-clip``, :mod:`fairseq_deepinit.methods.qk_clip`).

Per attention head ``h``, with ``S_h`` the largest scaled, masked logit ``scaling * q_i . k_j`` of the update's
forward passes (every micro-batch of ``--update-freq``, all-reduced with MAX over the data-parallel ranks):

    eta_h = tau / S_h if S_h > tau else 1;  W_q[h], b_q[h] *= eta_h ** alpha;  W_k[h], b_k[h] *= eta_h ** (1 - alpha)

so that every logit of the head scales by ``eta_h`` (Kimi K2, arXiv 2507.20534, Algorithm 1; Megatron-LM @ d98e8a6
``megatron/core/transformer/attention.py:1975-2070`` and ``megatron/core/optimizer/qk_clip.py:8-52``, whose
``clamp(tau / S, max=1)`` this replaces by the ``where`` above: no ``any`` read on the host, and a head whose
largest logit is negative keeps 1 instead of a NaN). fairseq's ``q_proj`` / ``k_proj`` have biases: they scale
with their rows, which Megatron's bias-free QKV does not need (``tests/ports/qk_clip.py`` ``clip_with_bias``).
The rows are scaled in the weights' dtype, at least float32 (float64 weights in float64, ``eta`` too): a head at or
under ``tau`` is multiplied by exactly 1.0, so it stays bit for bit; a non-finite ``S_h`` (a broken forward, which
the loss shows) clips nothing.

The tap (:class:`QKClip`): a forward pre-hook on each clipped attention recomputes its ``q`` and ``k`` from the
call's inputs with the module's own projections (:func:`fairseq_deepinit.modules.probe.project_qk`)
and keeps the per-head maximum (:func:`fairseq_deepinit.diagnostics.depth_stats.max_attention_logit`: padding
queries, padding keys and the future mask left out) in one device buffer, with ``torch.maximum``: nothing is
read on the host. Neither fairseq's fused training path (``F.multi_head_attention_forward``) nor
``F.scaled_dot_product_attention`` (``--attention-impl sdpa``) exposes the scores, so both pay one more ``q``/``k``
projection and score product per attention and forward (in float32 under ``--fp16`` / bf16).

The step: the record's ``after_step`` hook (:func:`step_hook`) is called for every optimizer fairseq's trainer
builds (:func:`fairseq_deepinit.patches.build_optimizer`, which routes that instance's ``step`` and ``zero_grad``
to the hooks of the methods that are on): :class:`ClipAfterStep` clips after each step, and resets the maxima at
each ``zero_grad`` (the start of an update; an update fairseq skips after an fp16 overflow clips nothing).
Where the step continues from fp32 master weights other than the model's (``--fp16``'s ``FP16Optimizer``, flat
or not), the clip scales the master rows and copies them into the model, as
``_sync_fp32_params_to_fp16`` does (``fairseq/optim/fp16_optimizer.py:148-170``), or the next step would undo it;
``--memory-efficient-fp16``, ``--amp`` and fp32 update the model's weights in place. Adam's moments are left as
they are (Kimi K2, Megatron). Refused (the record's ``check_training`` hook, :func:`check_training`):
``--zero-sharding os`` and ``--use-bmuf``, whose optimizers keep state of the weights outside the step this hook sees.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
from fairseq.logging import metrics
from torch import Tensor

from ..diagnostics import depth_stats
from ..diagnostics.depth_hooks import attention_modules, stack_inputs
from ..errors import DeepInitConfigError
from ..modules.probe import bound_arguments, project_qk

ATTR = "_deepinit_qk_clip"  # the model's QKClip (one per model, whatever rebuilds the optimizer)
HALF = (torch.float16, torch.bfloat16)


class QKClip:
    """The per-head maxima of the clipped attentions of ``model`` and the clip (module docstring)."""

    def __init__(self, model: nn.Module, tau: float, alpha: float, cross: bool) -> None:
        self.tau, self.alpha = float(tau), float(alpha)
        self.attentions: List[Tuple[str, nn.Module, slice]] = []
        start = 0
        for stack in ("encoder", "decoder"):
            layers = getattr(getattr(model, stack, None), "layers", None) or []
            for i in range(len(layers)):
                for name, attn in attention_modules(layers[i]):
                    if attn.encoder_decoder_attention and not cross:
                        continue
                    self.attentions.append((f"{stack}.layers.{i}.{name}", attn, slice(start, start + attn.num_heads)))
                    start += attn.num_heads
        device = next(model.parameters()).device
        self.maxima = torch.full((start,), -math.inf, dtype=torch.float32, device=device)
        self._real: Dict[str, Tensor] = {}
        self._handles = [
            model.register_forward_pre_hook(self._batch, with_kwargs=True),
            model.register_forward_hook(lambda *_: self._real.clear()),
        ]
        for name, attn, where in self.attentions:
            stack = name.split(".", 1)[0]
            self._handles.append(attn.register_forward_pre_hook(self._tap(stack, where), with_kwargs=True))

    def _batch(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Which positions of this forward are real, per stack (from the batch, as the diagnostics take them)."""
        self._real.clear()
        if model.training:
            net_input = bound_arguments(model, args, kwargs)
            self._real.update({stack: real for stack, _layers, real in stack_inputs(model, net_input)})

    def _tap(self, stack: str, where: slice):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            real = self._real.get(stack)
            if not module.training or real is None:
                return
            a = bound_arguments(module, args, kwargs)
            if a.get("incremental_state") is not None or a["query"].shape[:2] != real.shape:
                return
            with torch.no_grad():
                q, k = project_qk(module, a["query"], a.get("key"))
                if q.dtype in HALF:  # an fp16 score can overflow where the fp32 logit is only large
                    q, k = q.float(), k.float()
                per_head = depth_stats.max_attention_logit(
                    q, k, module.num_heads, real, a.get("key_padding_mask"), a.get("attn_mask")
                )
                slot = self.maxima[where]
                torch.maximum(slot, per_head.to(slot.dtype), out=slot)

        return hook

    def reset(self) -> None:
        self.maxima.fill_(-math.inf)

    def factors(self) -> Tensor:
        """``eta`` per head in float32 (the maxima's dtype), all ranks' maxima first combined (one all-reduce, no
        host read)."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from fairseq.distributed import utils as dist_utils

            dist_utils.all_reduce(self.maxima, group=dist_utils.get_data_parallel_group(), op="max")
        return eta_of(self.maxima, self.tau)

    def clip(self, masters: Dict[int, Tensor]) -> Tensor:
        """Rescale every clipped head's q/k rows (in ``masters``' fp32 copies where given) in the weights' dtype, at
        least float32 (:func:`scale_rows`); returns ``eta``. The maxima are kept until the next update's
        ``zero_grad`` (:class:`ClipAfterStep`)."""
        eta = self.factors()
        powers: Dict[torch.dtype, Tuple[Tensor, Tensor]] = {}  # per computing dtype: (eta^alpha, eta^(1 - alpha))
        with torch.no_grad():
            for _name, attn, where in self.attentions:
                for proj, side in ((attn.q_proj, 0), (attn.k_proj, 1)):
                    for param in (proj.weight, proj.bias):
                        if param is None:
                            continue
                        master = masters.get(id(param))
                        dtype = torch.promote_types((param if master is None else master).dtype, torch.float32)
                        if dtype not in powers:
                            e = eta if dtype == eta.dtype else eta_of(self.maxima.to(dtype), self.tau)
                            powers[dtype] = (e.pow(self.alpha), e.pow(1.0 - self.alpha))
                        scale_rows(param, master, powers[dtype][side][where])
        metrics.log_scalar("qk_clip_heads", (eta < 1).sum(), weight=1, round=2)
        metrics.log_scalar("qk_clip_max_logit", self.maxima.max(), weight=1, round=3)
        return eta


def eta_of(maxima: Tensor, tau: float) -> Tensor:
    """``tau / S_h`` where ``S_h > tau`` (finite), else exactly 1 (Kimi K2, Algorithm 1), in ``maxima``'s dtype."""
    return torch.where(torch.isfinite(maxima) & (maxima > tau), tau / maxima, torch.ones_like(maxima))


def scale_rows(param: Tensor, master: Tensor | None, f: Tensor) -> None:
    """``param``'s rows of head ``h`` times ``f[h]`` (``param`` ``(H * dh, ...)``), computed in ``f``'s dtype (the
    weights', at least float32: float64 weights are not rounded through float32, so a head with ``f = 1`` stays
    bit for bit); with a ``master`` (fp32, the weights the optimizer steps from), the master is scaled and copied
    into ``param``."""
    heads = f.numel()
    target = param.data if master is None else master
    rows = target.view(heads, -1)
    rows.copy_(rows.to(f.dtype).mul(f.view(heads, 1)))
    if master is not None:
        param.data.copy_(master.view_as(param))


def master_weights(optimizer: Any) -> Dict[int, Tensor]:
    """``id(model parameter) -> its fp32 master`` (a view) for fairseq's ``FP16Optimizer``, flat
    (``fp32_params`` one tensor per device, laid out as ``_sync_fp32_params_to_fp16`` reads it) or not (one
    fp32 parameter per parameter); empty where the optimizer steps the model's own weights."""
    fp32 = getattr(optimizer, "fp32_params", None)
    fp16 = getattr(optimizer, "fp16_params", None)
    if fp32 is None or fp16 is None:
        return {}
    out: Dict[int, Tensor] = {}
    if not optimizer.has_flat_params:
        for p, p32 in zip(fp16, fp32, strict=True):
            out[id(p)] = p32.data
        return out
    flats = fp32 if isinstance(fp32, dict) else {None: fp32}
    for device, flat in flats.items():
        offset = 0
        for p in fp16:
            if len(flats) > 1 and p.device.index != device:
                continue
            out[id(p)] = flat.data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    return out


def check_training(p: Any, spec: Any, cfg: Any) -> None:
    """QK-Clip's :class:`~fairseq_deepinit.methods.record.CheckTraining`: refuse the training set-ups whose
    optimizers hold the weights' state outside the step the clip follows (``cfg``: fairseq's ``Trainer.cfg``)."""
    if getattr(cfg.distributed_training, "zero_sharding", "none") == "os":
        raise DeepInitConfigError(
            "--qk-clip does not combine with --zero-sharding os (each rank's optimizer shard keeps its own fp32 "
            "state, which the clip after fairseq's step does not reach); drop one of them"
        )
    if getattr(cfg.optimization, "use_bmuf", False):
        raise DeepInitConfigError(
            "--qk-clip does not combine with --use-bmuf (BMUF's block average restores weights the clip changed "
            "since the last sync); drop one of them"
        )


class ClipAfterStep:
    """QK-Clip's :class:`~fairseq_deepinit.methods.record.StepHook` for one optimizer: the clip after each
    ``step``, the maxima reset at each ``zero_grad``; the fp32 masters found once, at the first step (they live
    as long as the optimizer)."""

    def __init__(self, clip: QKClip, optimizer: Any) -> None:
        self.clip, self.optimizer = clip, optimizer
        self.masters: Dict[int, Tensor] | None = None

    def new_update(self) -> None:
        self.clip.reset()

    def after_step(self) -> None:
        if self.masters is None:
            self.masters = master_weights(self.optimizer)
        self.clip.clip(self.masters)


def step_hook(p: Any, spec: Any, model: nn.Module, optimizer: Any) -> ClipAfterStep:
    """QK-Clip's :class:`~fairseq_deepinit.methods.record.AfterStep`: the tap on ``model`` (once, whatever
    rebuilds the optimizer) and the clip that follows ``optimizer``."""
    clip = model.__dict__.get(ATTR)
    if clip is None:
        clip = QKClip(model, p.qk_clip_threshold, p.qk_clip_alpha, p.qk_clip_cross)
        model.__dict__[ATTR] = clip
    return ClipAfterStep(clip, optimizer)
