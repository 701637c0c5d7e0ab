"""gpu_readiness.py's models and batches, built the way fairseq-train builds them, and one update of them."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, List

from deepinit_tools import fairseq_argv as fa
from deepinit_tools.bench.readiness_table import NORM_TARGETS, REFUSED
from deepinit_tools.harness import counters
from deepinit_tools.harness.fairseq_train import Shape

DROPOUTS = ("--dropout", "0.1", "--attention-dropout", "0.1", "--activation-dropout", "0.1")


def plugin() -> Any:
    """The plugin (imported here, once: it registers its models, tasks and criteria)."""
    import fairseq_deepinit

    return fairseq_deepinit


# --- building models and batches the way fairseq-train does ----------------------------------------


def dictionary():
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(60):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=8)
    return d


@dataclasses.dataclass
class Built:
    """One configuration built by fairseq's parser, task and optimizer, ready for updates."""

    kind: str  # "mt" or "lm"
    args: Any
    task: Any
    model: Any
    criterion: Any
    optimizer: Any


def dims(kind: str, shape: Shape) -> List[str]:
    """Dimension flags of one shape (both stacks for translation, the decoder for a language model)."""
    if kind == "mt":
        return shape.flags()
    return [*fa.dims(shape.layers, shape.dim, shape.ffn, shape.heads, ("decoder",)), "--tokens-per-sample", "64"]


def build(kind: str, arch: str, shape: Shape, *extra: str, task: str | None = None, meta: bool = False) -> Built:
    """``arch`` (plus ``extra`` flags) built by fairseq's parser, task and optimizer registry from the parsed
    arguments (fairseq-train's route without the omegaconf round trip, seconds per model); ``meta``: the
    model moved to the meta device."""
    import torch
    from fairseq import optim, options, tasks

    task = task or ("translation" if kind == "mt" else "language_modeling")
    lang = ["-s", "src", "-t", "tgt"] if kind == "mt" else []
    argv = ["/nonexistent", "--task", task, *lang, "--arch", arch, *dims(kind, shape), *DROPOUTS,
            *fa.ADAM, "--lr", "1e-3",
            "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", *extra]  # fmt: skip
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    d = dictionary()
    task_obj = tasks.TASK_REGISTRY[args.task](args, d, d)
    torch.manual_seed(1)
    model = task_obj.build_model(args)
    criterion = task_obj.build_criterion(args)
    if meta:
        counters.to_meta(model)
    optimizer = optim.build_optimizer(args, [p for p in model.parameters() if p.requires_grad])
    return Built(kind, args, task_obj, model, criterion, optimizer)


def batch(kind: str, device: str = "cpu") -> dict:
    """Four sentences as fairseq's collaters pad them: sources on the left, targets on the right."""
    import torch
    from fairseq.data import data_utils

    d = dictionary()
    g = torch.Generator().manual_seed(0)

    def sentences(lengths):
        return [torch.cat([torch.randint(4, 4 + 60, (n,), generator=g), torch.tensor([d.eos()])]) for n in lengths]

    tgts = sentences((6, 4, 8, 5))
    target = data_utils.collate_tokens(tgts, d.pad(), d.eos(), left_pad=False)
    prev = data_utils.collate_tokens(tgts, d.pad(), d.eos(), left_pad=False, move_eos_to_beginning=True)
    ntokens = int(target.ne(d.pad()).sum())
    if kind == "mt":
        srcs = sentences((7, 5, 6, 3))
        src = data_utils.collate_tokens(srcs, d.pad(), d.eos(), left_pad=True)
        net = {"src_tokens": src, "src_lengths": torch.tensor([len(s) for s in srcs]), "prev_output_tokens": prev}
    else:  # language modeling: the input is the target shifted right, padded on the right
        net = {"src_tokens": prev, "src_lengths": prev.ne(d.pad()).sum(1)}
    sample = {"id": torch.arange(4), "net_input": net, "target": target, "ntokens": ntokens, "nsentences": 4}
    return counters.tensors_to(sample, device)


@contextlib.contextmanager
def fairseq_clip_on_device() -> Iterator[None]:
    """fairseq's ``clip_grad_norm_`` takes every gradient's norm to ``torch.device("cpu")`` when CUDA is
    unavailable (fairseq/utils.py:373-386); on a GPU they stay there (apex's multi-tensor norm, or
    ``torch.cuda.current_device()``). The meta runs take that GPU branch: one total norm on the device."""
    import torch
    from fairseq import utils

    saved = utils.multi_tensor_l2norm_available, utils.multi_tensor_total_norm

    def total_norm(grads, chunk_size=None):
        return torch.norm(torch.stack([torch.norm(g, p=2, dtype=torch.float32) for g in grads]))

    utils.multi_tensor_l2norm_available, utils.multi_tensor_total_norm = True, total_norm
    try:
        yield
    finally:
        utils.multi_tensor_l2norm_available, utils.multi_tensor_total_norm = saved


def update(b: Built, sample: dict, update_num: int, autocast: bool = False) -> None:
    """One fairseq training update (``Trainer.train_step`` without its bookkeeping): zero the gradients,
    ``task.train_step`` (forward, loss, backward), ``multiply_grads``, ``clip_grad_norm``,
    ``task.optimizer_step`` and ``task.reduce_metrics`` (where statistics are read, as fairseq does).
    ``autocast``: the forward and loss under ``torch.autocast("cpu", torch.bfloat16)``, backward outside."""
    import torch
    from fairseq.logging import metrics

    b.optimizer.zero_grad()
    if autocast:
        b.model.train()
        b.model.set_num_updates(update_num)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, size, log = b.criterion(b.model, sample)
        b.optimizer.backward(loss)
    else:
        _, size, log = b.task.train_step(sample, b.model, b.criterion, b.optimizer, update_num)
    b.optimizer.multiply_grads(1.0 / float(size or 1))
    with fairseq_clip_on_device():
        b.optimizer.clip_grad_norm(0.0)
    b.task.optimizer_step(b.optimizer, b.model, update_num)
    with metrics.aggregate(new_root=True):
        b.task.reduce_metrics([log], b.criterion)


def reads(fn: Callable[[], Any], meta: bool) -> counters.HostReads:
    """Host reads while ``fn`` runs: on ``meta`` (stand-in values) or with the CPU as the device."""
    with counters.HostReads(cpu_is_device=not meta, stand_in=meta) as hr:
        fn()
    return hr


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"


def refused(e: BaseException, flag: str) -> bool:
    """The plugin refused ``flag`` in its one line (a family that cannot take that configuration)."""
    return type(e).__name__ == "DeepInitConfigError" and flag in str(e)


def fp32_cell(e: BaseException, checkpoint: bool, impl: str = "fairseq") -> str:
    """The fp32-matmul cell of a configuration that failed: :data:`REFUSED` where the plugin refused
    ``--checkpoint-activations`` (a family that cannot be recomputed) or ``--attention-impl sdpa`` (one whose
    attention logits must be materialised) in its one line, else the error."""
    if (checkpoint and refused(e, "--checkpoint-activations")) or (impl == "sdpa" and refused(e, SDPA)):
        return REFUSED
    return one_line(e)


SDPA = "--attention-impl sdpa"


def update_ops(kind: str, arch: str, shape: Shape, *extra: str, task: str | None = None) -> tuple:
    """``(kernels, built)``: the :class:`counters.OpCounter` of one training update after a warm-up one (the
    first warms caches and profiles Admin), the recipes' dropouts on, and the model it counted."""
    b = build(kind, arch, shape, *extra, task=task)
    sample = batch(kind)
    update(b, sample, 0)
    with counters.OpCounter() as ops:
        update(b, sample, 1)
    return ops, b


# the norm table's cases: (label, input dtype, weight dtype); the last one is CUDA autocast's (fp32
# weights, 16-bit activations, as a norm inside a sub-layer sees them: Sub-LN's, NormFormer's)
NORM_CASES = (("fp16", "float16", "float16"), ("fp32", "float32", "float32"),
              ("bf16 input, fp32 weights (autocast)", "bfloat16", "float32"))  # fmt: skip


def norm_kernels() -> List[dict]:
    """Kernels of one norm's forward and backward (d 512) as CUDA would launch them: counted on the ``meta``
    device, where the plugin's norms take their non-CPU path (fused calls once). In the autocast case
    LayerNorm runs as CUDA autocast runs it (``layer_norm`` is on autocast's fp32 list): on an fp32 copy
    of the input, whose gradient is cast back."""
    import torch

    from fairseq_deepinit.modules.norms import build_norm

    rows = []
    for label, x_dtype, w_dtype in NORM_CASES:
        xd, wd = getattr(torch, x_dtype), getattr(torch, w_dtype)
        counts = {}
        for norm_type in ("layernorm", "rmsnorm", "scalenorm", "zc-rmsnorm"):
            norm = build_norm(norm_type, 512, 1e-5, False).to(device="meta", dtype=wd)
            cast = norm_type == "layernorm" and xd != wd
            x = torch.empty(8, 4, 512, device="meta", dtype=xd, requires_grad=True)
            with counters.OpCounter() as fwd:
                y = norm(x.to(wd) if cast else x)
            dy = torch.empty_like(y)
            with counters.OpCounter() as bwd:
                y.backward(dy)
            counts[norm_type] = fwd.total + bwd.total
        ln = counts["layernorm"]
        for norm_type, n in counts.items():
            target = NORM_TARGETS.get(norm_type)
            rows.append({"norm": norm_type, "dtype": label, "kernels": n,
                         "limit": None if target is None else ln + target,
                         "ok": None if target is None else n <= ln + target})  # fmt: skip
    return rows
