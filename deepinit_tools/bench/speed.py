#!/usr/bin/env python
"""fairseq-train tokens/s, loss curve and peak memory for the speed options (docs/speed.md).

Two experiments, each a set of real ``fairseq-train`` runs (one process per run, same data, seed,
``--max-tokens`` and so the same batches), repeated ``--repeats`` times in rotating order so that
slow drifts of a shared machine hit every configuration alike:

- ``attention``: stock fairseq ``--arch transformer`` (fp32; on CUDA also ``--fp16`` and ``--amp``)
  against the plugin at the same dimensions with ``--attention-impl fairseq`` / ``sdpa`` and
  ``--task translation_deepinit --autocast-bf16``. Reported: median ``wps`` over the ``train_inner``
  log lines (the first, which holds start-up, dropped) and its ratio to stock fp32 (and to stock
  ``--fp16`` on CUDA), the loss at every log interval (the loss curve), peak memory.
- ``deep``: the 200+200-layer T-Fixup model (``--arch tfixup_iwslt_de_en_200l``, T-Fixup Fig. 4b)
  with and without ``--checkpoint-activations``: tokens/s and peak memory.

Peak memory is the run's peak RSS (``ru_maxrss``) and, on CUDA, ``torch.cuda.max_memory_allocated``.
Data: Multi30k de-en train, lower-cased, whitespace tokens, binarised once (min count 2) into
``work-data/speed/`` (git-ignored), or any binarised de-en folder given with ``--data``.

- ``module``: one attention module, fairseq's forward vs SDPA, per call site (forward + backward;
  ``--updates`` calls per timing, best of ``--repeats``).
- ``check``: not a timing: the plugin's model with ``--attention-impl fairseq`` and ``sdpa`` on one
  padded batch on ``--device`` (fp32 logits/gradients, bf16-autocast loss), and on CUDA whether the
  flash / memory-efficient kernels accept causal bf16 attention.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed.py attention --shape 6x256x1024x4 --updates 40
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed.py deep --max-tokens 1024 --updates 6
    .venv/bin/python benchmarks/speed.py attention --device cuda --shape 6x512x2048x8 --max-tokens 8192 \\
        --updates 300 --log-interval 50 --repeats 3            # transformer base on one GPU
    .venv/bin/python benchmarks/speed.py deep --device cuda --max-tokens 4096 --updates 50
    .venv/bin/python benchmarks/speed.py check --device cuda --shape 6x512x2048x8
    .venv/bin/python benchmarks/speed.py module --device cuda --shape 6x512x2048x8 --max-tokens 8192 --bf16
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.harness.fairseq_tools import run_tool, train_inner
from deepinit_tools.harness.fairseq_train import Shape
from deepinit_tools.multi30k import DEFAULT_MULTI30K, binarize_multi30k
from deepinit_tools.paths import REPO, USER_DIR

WORK = REPO / "work-data" / "speed"


def plugin() -> SimpleNamespace:
    """Every import from fairseq_deepinit in this script (one place, for the package's re-layout)."""
    import fairseq_deepinit
    from fairseq_deepinit.modules.attention import SDPAMultiheadAttention

    return SimpleNamespace(package=fairseq_deepinit, use_sdpa=SDPAMultiheadAttention.like)


def configs(experiment: str, device: str, shape: Shape) -> dict:
    """name -> fairseq-train flags (beyond the common ones)."""
    if experiment == "deep":
        deep = ["--arch", "tfixup_iwslt_de_en_200l", "--lr-scheduler", "tfixup", "--lr", "1e-4"]
        return {"200l": deep, "200l-checkpoint-activations": [*deep, "--checkpoint-activations"]}
    dims = shape.flags()
    plugin_model = ["--arch", "deepinit", "--init-scheme", "fairseq", *dims]  # fairseq's own init: stock's model
    out = {
        "stock": ["--arch", "transformer", *dims],
        "deepinit-fairseq-attn": [*plugin_model, "--attention-impl", "fairseq"],
        "sdpa": [*plugin_model, "--attention-impl", "sdpa"],
        "sdpa-bf16": [*plugin_model, "--attention-impl", "sdpa", *fa.precision_flags("bf16")],
    }
    if device == "cuda":
        out["stock-fp16"] = [*out["stock"], "--fp16"]
        out["stock-amp"] = [*out["stock"], "--amp"]
    return out


def run(name: str, flags: list, opts, data: Path, log_dir: Path, round_: int) -> dict:
    """One fairseq-train process: wps per log interval (the first dropped), losses, peak memory."""
    common = [
        data, "--user-dir", USER_DIR, "-s", "de", "-t", "en", *fa.ADAM,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", opts.max_tokens,
        "--max-update", opts.updates, "--log-format", "simple", "--log-interval", opts.log_interval,
        "--disable-validation", "--no-save", "--seed", opts.seed, "--num-workers", "0",
    ]  # fmt: skip
    if "--lr" not in flags:
        common += ["--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000"]
    if "--task" not in flags:
        common += ["--task", "translation"]
    if opts.device == "cpu":
        common.append("--cpu")
    argv = [str(a) for a in [*common, *flags]]
    res = run_tool("train", argv, log=log_dir / f"{name}.{round_}.log")
    inner = train_inner(res.output)
    return {
        "wps": [s["wps"] for s in inner[1:]],
        "loss": [s["loss"] for s in inner],
        "updates": [int(s["num_updates"]) for s in inner],
        "rss_mb": res.peak_rss_mib,
        "cuda_mb": res.peak_cuda_mib or 0.0,
        "command": "fairseq-train " + " ".join(argv),
    }


def check(opts) -> None:
    """Numerical check on ``opts.device``: one model, fairseq vs sdpa attention, on a padded batch.

    fp32: logits and gradients must agree (TF32 off); bf16 autocast: the loss of both impls vs fp32.
    Also reports whether PyTorch can run the causal decoder self-attention on the flash kernel.
    """
    import torch
    import torch.nn.functional as F
    from fairseq import options
    from fairseq.data import Dictionary
    from fairseq.tasks.translation import TranslationTask

    plugin()  # registers the plugin's model and --attention-impl
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(opts.device)
    d = Dictionary()
    for i in range(1000):
        d.add_symbol(f"w{i}")
    models = {}
    for impl in ("fairseq", "sdpa"):
        cli = ["/x", "--task", "translation", "--arch", "deepinit", "-s", "a", "-t", "b", *opts.shape.flags()]
        args = options.parse_args_and_arch(
            options.get_training_parser(), [*cli, "--dropout", "0", "--attention-impl", impl]
        )
        torch.manual_seed(0)
        models[impl] = TranslationTask(args, d, d).build_model(args).to(device)
    models["sdpa"].load_state_dict(models["fairseq"].state_dict())
    g = torch.Generator().manual_seed(0)
    bsz, slen, tlen = 16, 40, 37
    src = torch.randint(4, 1000, (bsz, slen), generator=g)
    prev = torch.randint(4, 1000, (bsz, tlen), generator=g)
    for i in range(0, bsz, 3):
        src[i, : i % 11] = d.pad()  # left-padded sources
        prev[i, tlen - i % 9 :] = d.pad()  # right-padded targets
    batch = {"src_tokens": src.to(device), "src_lengths": src.ne(d.pad()).sum(1).to(device),
             "prev_output_tokens": prev.to(device)}  # fmt: skip
    target = torch.randint(4, 1000, (bsz, tlen), generator=g).to(device)
    keep = prev.ne(d.pad()).to(device)
    out = {}
    for impl, model in models.items():
        for bf16 in (False, True):
            model.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits, _ = model(**batch)
                loss = F.cross_entropy(logits[keep].float(), target[keep])
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            out[impl, bf16] = (logits.detach().float(), loss.item(), grads)
    (l_ref, loss_ref, g_ref), (l_new, loss_new, g_new) = out["fairseq", False], out["sdpa", False]
    print(
        f"fp32 max |logit diff| {(l_new - l_ref).abs().max().item():.3g} (logit scale {l_ref.abs().max().item():.3g})"
    )
    print(f"fp32 loss {loss_ref:.6f} vs {loss_new:.6f}; max |grad diff| {(g_new - g_ref).abs().max().item():.3g} "
          f"(grad scale {g_ref.abs().max().item():.3g})")  # fmt: skip
    for impl in ("fairseq", "sdpa"):
        rel = abs(out[impl, True][1] - loss_ref) / loss_ref
        print(f"bf16 autocast loss ({impl}) {out[impl, True][1]:.6f}: relative difference to fp32 {rel:.2e}")
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(bsz, 8, tlen, 64, device=device, dtype=torch.bfloat16)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True)
                print(f"{backend.name}: available for causal bf16 self-attention")
            except RuntimeError as e:
                print(f"{backend.name}: NOT available ({str(e).splitlines()[0]})")


def module_bench(opts) -> None:
    """One attention module, fairseq's forward vs the SDPA one: forward + backward time per call.

    Shapes: ``--shape``'s dim and heads, a batch of ``--max-tokens`` target tokens in sentences of
    ``--seq-len`` tokens (every other sentence padded by a quarter). CPU: process CPU time (robust
    to other processes on a shared machine); CUDA: wall time after synchronising.
    """
    import copy
    import time

    import torch
    from fairseq import utils
    from fairseq.modules.multihead_attention import MultiheadAttention

    use_sdpa = plugin().use_sdpa
    dim, heads = opts.shape.dim, opts.shape.heads
    device = torch.device(opts.device)
    t = opts.seq_len
    bsz = max(1, opts.max_tokens // t)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, bsz, dim, generator=g).to(device)
    enc = torch.randn(t, bsz, dim, generator=g).to(device)
    pad = torch.zeros(bsz, t, dtype=torch.bool)
    pad[::2, : t // 4] = True  # left-padded sources
    src_pad = pad.to(device)
    tgt_pad = pad.flip(1).to(device)  # right-padded targets
    future = torch.triu(utils.fill_with_neg_inf(torch.zeros(t, t)), 1).to(device)
    cases = {
        "encoder self-attention, padded": (dict(self_attention=True), (x,), dict(key_padding_mask=src_pad)),
        "decoder self-attention, causal": (dict(self_attention=True), (x,), dict(attn_mask=future)),
        "decoder self-attention, causal + padded": (
            dict(self_attention=True),
            (x,),
            dict(attn_mask=future, key_padding_mask=tgt_pad),
        ),  # fmt: skip
        "encoder-decoder attention, padded": (
            dict(encoder_decoder_attention=True),
            (x, enc),
            dict(key_padding_mask=src_pad, static_kv=True),
        ),  # fmt: skip
    }
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def timed(module, inputs, kwargs) -> float:
        best = float("inf")
        for _ in range(opts.repeats + 1):  # the first round warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            for _ in range(opts.updates):
                leaves = [v.detach().requires_grad_() for v in inputs]
                query, key = leaves[0], leaves[-1]
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts.bf16):
                    out, _ = module(query, key, key, need_weights=False, **kwargs)
                out.float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, (clock() - start) / opts.updates * 1e3)
        return best

    print(f"attention module, d={dim}, {heads} heads, batch {bsz} x {t} tokens, {opts.device}, "
          f"{'bf16 autocast' if opts.bf16 else 'fp32'}; ms per forward+backward (best of {opts.repeats})")  # fmt: skip
    print("| case | fairseq | sdpa | speed-up |\n|---|---|---|---|")
    for name, (ctor, inputs, kwargs) in cases.items():
        torch.manual_seed(0)
        ref = MultiheadAttention(dim, heads, **ctor).to(device)
        fast = use_sdpa(copy.deepcopy(ref))
        a, b = timed(ref, inputs, kwargs), timed(fast, inputs, kwargs)
        a, b = min(a, timed(ref, inputs, kwargs)), min(b, timed(fast, inputs, kwargs))  # interleaved twice
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


def build_parser() -> harness.Parser:
    """Every option of speed.py, with its help and default."""
    pos = harness.positive_int
    p = harness.Parser(prog="speed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=("attention", "deep", "check", "module"), help="what to measure")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    p.add_argument("--shape", type=Shape.parse, default=Shape.parse("6x256x1024x4"),
                   help="attention/check/module: LAYERSxDIMxFFNxHEADS (base: 6x512x2048x8)")  # fmt: skip
    p.add_argument("--max-tokens", type=pos, default=1024, help="tokens per batch")
    p.add_argument("--updates", type=pos, default=40, help="--max-update of every run (module: calls per timing)")
    p.add_argument("--log-interval", type=pos, default=10, help="fairseq-train --log-interval")
    p.add_argument("--repeats", type=pos, default=2, help="interleaved rounds (module: best of)")
    p.add_argument("--seed", type=int, default=1, help="fairseq-train --seed")
    p.add_argument("--configs", nargs="+", help="subset of the experiment's configurations (default: all)")
    p.add_argument("--data", type=Path, help="binarised de-en data (default: Multi30k, binarised once)")
    p.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K, help="Multi30k's *.gz (env MULTI30K_DIR)")
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--seq-len", type=pos, default=32, help="module: tokens per sentence")
    p.add_argument("--bf16", action="store_true", help="module: run under bf16 autocast")
    return p


def main(argv=None) -> None:
    """Run one experiment; prints a markdown table (attention, deep) or the check/module report."""
    p = build_parser()
    opts = p.parse_args(argv)
    if opts.experiment == "check":
        return check(opts)
    if opts.experiment == "module":
        return module_bench(opts)
    if opts.log_interval >= opts.updates:
        p.error("--log-interval must be below --updates (the first log interval is dropped as start-up)")
    splits = {"train": ("train", None), "valid": ("val", None)}
    data = opts.data or binarize_multi30k(opts.multi30k, WORK / "bin", splits, tokenizer="lower")
    runs = configs(opts.experiment, opts.device, opts.shape)
    if opts.configs:
        unknown = set(opts.configs) - set(runs)
        if unknown:
            p.error(f"unknown configurations {sorted(unknown)}; choose from {sorted(runs)}")
        runs = {k: v for k, v in runs.items() if k in opts.configs}
    log_dir = WORK / "logs" / opts.experiment
    log_dir.mkdir(parents=True, exist_ok=True)
    names = list(runs)
    results: dict = {n: [] for n in names}
    for r in range(opts.repeats):
        for name in harness.rotation(names, r):
            res = run(name, runs[name], opts, data, log_dir, r)
            results[name].append(res)
            print(f"round {r} {name}: median wps {harness.median(res['wps']):.1f}", flush=True)

    def wps(name: str) -> float:
        return harness.median(list(itertools.chain.from_iterable(r["wps"] for r in results[name])))

    refs = [n for n in ("stock", "stock-fp16", "200l") if n in results]
    what = f"shape {opts.shape}" if opts.experiment == "attention" else "tfixup_iwslt_de_en_200l"
    meta = harness.environment(opts.device, "speed.py", argv)
    print(f"\n{opts.experiment}: device {opts.device}, {what}, --max-tokens {opts.max_tokens}, "
          f"{opts.updates} updates x {opts.repeats} runs")  # fmt: skip
    print(harness.provenance(meta))
    header = ["config", "tokens/s (median)", *[f"vs {r}" for r in refs], "peak RSS MB", "peak CUDA MB"]
    rows = [
        [name, f"{wps(name):.1f}", *[f"{wps(name) / wps(r):.2f}x" for r in refs],
         f"{max(r['rss_mb'] for r in results[name]):.0f}", f"{max(r['cuda_mb'] for r in results[name]):.0f}"]
        for name in names
    ]  # fmt: skip
    print(harness.markdown_table(header, rows, right=range(1, len(header))))
    print("\nloss at updates " + ", ".join(map(str, results[names[0]][0]["updates"])) + " (run 0):")
    for name in names:
        print(f"  {name}: " + ", ".join(f"{x:.3f}" for x in results[name][0]["loss"]))
    harness.write_json(opts.json, {"options": {k: str(v) for k, v in vars(opts).items()}, "results": results}, meta)
