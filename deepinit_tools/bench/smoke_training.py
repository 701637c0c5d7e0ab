"""The training rows of gpu_smoke.py: the plugin's optimizers and every method with a training hook, stepped by
fairseq's own ``Trainer`` in fp16 and bf16 autocast.

The architecture rows of gpu_smoke.py step their models with the harness's copy of fairseq's update, which runs
none of the hooks fairseq's trainer runs for a method (:data:`fairseq_deepinit.methods.TRAINING_HOOKS`: a check,
optimizer groups, a step hook, a loss term) and only fairseq's Adam. Here each :class:`Setup` (a tiny 2+2-layer
translation model, :func:`deepinit_tools.harness.tiny.tiny_trainer`) trains ``--steps`` updates through
``Trainer.train_step``, as ``fairseq-train`` does: ``fp16`` is ``--fp16`` with what the set-up needs beside it
(Muon: ``--fp16-no-flatten-grads``), ``bf16-autocast`` the plugin's ``--task translation_deepinit
--autocast-bf16``. A row passes when at least one update was applied, every loss and weight is finite and every
weight moved, the optimizer's state is float32, the metrics the set-up's methods log are there and finite, and
the methods with a training hook that are on are the ones the set-up names. It records the host syncs per
update (beside ``train:adam``, fairseq's Adam through the same trainer; on the CPU the count includes reads of
tensors a CUDA run keeps on the host, torch's optimizers' step counters: RAdam's) and the attention path. Off
CUDA, ``fp16`` through fairseq's flat fp32 master (CUDA only) runs in fp32 and the row says so.

:data:`SETUPS` names every optimizer the plugin registers and every method with a training hook (the tests check
that against the registries), so a new one cannot miss the GPU session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from types import SimpleNamespace
from typing import Tuple

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.bench.smoke_counts import _Recorder, count_host_syncs, record_attention
from deepinit_tools.paths import import_plugin

TRAINING_STEPS_FLOOR = 1  # updates that must be applied (fp16's first steps may overflow while the scale settles)
QK_CLIP_LOGS = ("qk_clip_heads", "qk_clip_max_logit")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training row: ``flags`` select it, ``fp16`` is what ``--fp16`` needs beside them, ``family`` the
    model's, ``methods`` the methods with a training hook it turns on, ``logs`` the metrics those log."""

    name: str
    flags: Tuple[str, ...]
    fp16: Tuple[str, ...] = ()
    family: str = "preln"
    methods: Tuple[str, ...] = ()
    logs: Tuple[str, ...] = ()

    @property
    def optimizer(self) -> str:
        return self.flags[self.flags.index("--optimizer") + 1]

    def ran_as(self, precision: str, device: str) -> str:
        """``precision``, or ``fp32`` for ``fp16`` off CUDA through fairseq's flat fp32 master (CUDA only)."""
        flat = precision == "fp16" and not set(NO_FLAT) <= set(self.fp16)
        return "fp32" if flat and device != "cuda" else precision


MUON = ("--optimizer", "muon")
NO_FLAT = ("--fp16-no-flatten-grads",)  # Muon orthogonalises each matrix: fairseq's flat fp32 master is refused
SETUPS: Tuple[Setup, ...] = (
    Setup("train:adam", fa.ADAM),  # fairseq's Adam: the reference row
    Setup("train:adam_foreach", fa.adam("adam_foreach")),
    Setup("train:radam", ("--optimizer", "radam")),
    Setup("train:muon", MUON, NO_FLAT),
    Setup("train:muonclip", (*MUON, "--qk-clip"), NO_FLAT, methods=("qk_clip",), logs=QK_CLIP_LOGS),
    # fairseq's Adam under --fp16 keeps one flat fp32 master: the clip must reach it
    Setup("train:qk_clip", (*fa.ADAM, "--qk-clip"), methods=("qk_clip",), logs=QK_CLIP_LOGS),
    Setup(
        "train:z_loss",
        (*fa.ADAM, "--z-loss", "--criterion", "label_smoothed_cross_entropy_zloss"),
        methods=("z_loss",),
        logs=("z_loss", "z_loss_unscaled"),
    ),  # fmt: skip
    # depth-muP's per-group rates: no flat master either
    Setup("train:depth_mup", fa.adam("adam_foreach"), NO_FLAT, family="depth_mup", methods=("depth_mup",)),
)


def flags(s: Setup, precision: str) -> Tuple[str, ...]:
    """``s``'s options in ``precision`` (``fp16``, ``bf16-autocast`` or ``fp32``)."""
    extra = {"fp16": ("--fp16", *s.fp16), "bf16-autocast": tuple(fa.precision_flags("bf16")), "fp32": ()}
    return (*s.flags, *extra[precision])


def plugin() -> SimpleNamespace:
    """Every import from fairseq, the plugin and the tiny trainer in this module (the plugin checked first)."""
    import_plugin()
    from fairseq.logging import metrics

    from deepinit_tools.harness import tiny
    from fairseq_deepinit.methods import TRAINING_HOOKS, enabled
    from fairseq_deepinit.training.param_groups import innermost

    return SimpleNamespace(metrics=metrics, tiny=tiny, hooks=TRAINING_HOOKS, enabled=enabled, innermost=innermost)


def training_methods(spec) -> Tuple[str, ...]:
    """The methods with a training hook that are on in ``spec`` (by their records)."""
    x = plugin()
    return tuple(m.name for m, _ in x.enabled(spec) if any(getattr(m, hook) is not None for hook in x.hooks))


def state_dtypes(trainer) -> Tuple[str, ...]:
    """The dtypes of the floating-point state the trainer's optimizer keeps (below fairseq's wrappers)."""
    state = plugin().innermost(trainer.optimizer).optimizer.state
    found = {str(v.dtype).replace("torch.", "") for s in state.values() for v in s.values()
             if hasattr(v, "dtype") and v.is_floating_point()}  # fmt: skip
    return tuple(sorted(found))


def smoke_training_one(s: Setup, precision: str, opts) -> dict:
    """Build ``s`` in ``precision`` on ``opts.device``, train ``opts.steps`` updates; what was seen, or the error."""
    import torch

    x = plugin()
    cuda, ran = opts.device == "cuda", s.ran_as(precision, opts.device)
    out: dict = {"arch": s.name, "fairseq_arch": f"{s.family}_iwslt_de_en", "precision": precision,
                 "ran_as": ran, "flags": " ".join(flags(s, ran))}  # fmt: skip
    if ran != precision:
        out["note"] = "fp32 (fp16 needs CUDA: fairseq's flat fp16 master is CUDA-only)"
    t0 = time.perf_counter()
    rec = _Recorder()
    try:
        with harness.peak(opts.device) if cuda else contextlib.nullcontext() as box:
            impl = () if opts.attention_impl == "fairseq" else ("--attention-impl", opts.attention_impl)
            trainer = x.tiny.tiny_trainer("mt", *flags(s, ran), *impl, family=s.family, cpu=not cuda)
            model = trainer.model
            before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
            losses, syncs = [], []
            with x.metrics.aggregate(new_root=True) as agg, record_attention(model, rec):
                for step in range(opts.steps):
                    with count_host_syncs(opts.device) as n:
                        log = trainer.train_step([x.tiny.tiny_sample("mt", seed=step)])
                    syncs.append(n["n"])
                    losses.append(None if log is None else round(float(log["loss"]), 4))
                logged = {k: float(v) for k, v in agg.get_smoothed_values().items() if k in s.logs}
            still = [n for n, p in model.named_parameters() if torch.equal(p.detach().float(), before[n])]
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            on, dtypes = training_methods(model.spec), state_dtypes(trainer)
        applied = [x for x in losses if x is not None]
        problems = [
            *([f"{len(applied)} of {opts.steps} updates applied"] if len(applied) < TRAINING_STEPS_FLOOR else []),
            *(["non-finite training loss"] if not all(math.isfinite(x) for x in applied) else []),
            *(["non-finite weights"] if not finite else []),
            *([f"{len(still)} weights never moved ({still[0]} ...)"] if still and applied else []),
            *([f"optimizer state in {', '.join(dtypes)}, not float32"] if dtypes != ("float32",) else []),
            *(
                [f"methods with a training hook on: {on or 'none'}, want {s.methods or 'none'}"]
                if set(on) != set(s.methods)
                else []
            ),  # fmt: skip
            *([f"not logged: {', '.join(k for k in s.logs if k not in logged)}"] if set(logged) != set(s.logs) else []),
            *(["non-finite logged metric"] if not all(math.isfinite(v) for v in logged.values()) else []),
        ]
        out.update(
            status="failed" if problems else "ok",
            train_losses=losses,
            optimizer=s.optimizer,
            training_methods=list(on),
            logged={k: round(v, 4) for k, v in logged.items()},
            optimizer_state=list(dtypes),
            syncs_per_train_step=syncs,
            sdpa_train={k: dict(v) for k, v in rec.backends.items()},
            peak_mem_mib=None if box is None or box.mib is None else round(box.mib, 1),
        )
        if problems:
            out["error"] = "; ".join(problems)
        del trainer, model
    except Exception as e:  # noqa: BLE001  (recorded in the row; the next set-up runs)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        out.update(status="error", error=f"{type(e).__name__}: {first}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    if cuda:
        torch.cuda.empty_cache()
    return out
