"""Golden values of every family: parameter order, state-dict keys and fixed-seed outputs.

A refactoring of the model code must leave three things exactly as they are:

- the ``state_dict`` keys and their order (checkpoints load by name; fairseq's optimizer state follows
  the order of ``named_parameters``, so a resumed run needs that order too);
- the outputs: logits of a fixed-seed tiny model on a fixed padded batch in training mode (dropout on),
  the gradients of a fixed loss, the eval-mode logits and three steps of incremental decoding;
- for every translation family (``<family>_iwslt_de_en`` at tiny dims), every language-model family
  (``<family>_lm_tiny``) and the option variants below.

Keys and order are compared everywhere; outputs bit for bit on each kernel path the fixture has them for
(:func:`platform`: they are float32 sums whose rounding depends on the CPU's vector width and on the BLAS
library's code path, which MKL picks by the CPU's vendor; another path gives other bits, which
``tests/test_compat_v010.py`` and the numeric tests cover with tolerances). The fixture keeps one set of output
digests per platform: ``--write`` replaces the keys and order of every case and the current platform's outputs,
and keeps the other platforms' (recorded from the same code on their machines).

Regenerate (only when a change of keys or outputs is intended, and say so in the commit)::

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "golden.json"
N_SYMBOLS = 50
TINY_MT = [
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.1",
]  # fmt: skip
TINY_LM = [
    "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
    "--decoder-layers", "2", "--dropout", "0.1", "--tokens-per-sample", "16",
]  # fmt: skip

# option variants beyond the named families: (name, arch, extra flags)
MT_VARIANTS = [
    ("preln-sdpa", "preln_iwslt_de_en", ["--attention-impl", "sdpa"]),
    ("postln-sdpa", "postln_iwslt_de_en", ["--attention-impl", "sdpa"]),
    ("postln-fairseq-init", "postln_iwslt_de_en", ["--init-scheme", "fairseq"]),
    ("postln-no-cross", "postln_iwslt_de_en", ["--no-cross-attention"]),
    ("preln-rmsnorm-lnemb", "preln_iwslt_de_en", ["--norm-type", "rmsnorm", "--layernorm-embedding"]),
    ("preln-checkpoint", "preln_iwslt_de_en", ["--checkpoint-activations"]),
    ("lipschitz-bias-free", "lipschitz_iwslt_de_en", ["--lipschitz-bias-free"]),
    ("lipschitz-bias-free-matt", "matt_iwslt_de_en", ["--init-scheme", "lipschitz", "--lipschitz-bias-free"]),
    ("lipschitz-bias-free-matt-self-attn", "matt_iwslt_de_en",
     ["--init-scheme", "lipschitz", "--lipschitz-bias-free", "--matt-self-branch", "self-attn"]),
    ("dsinit-code", "dsinit_iwslt_de_en", ["--ds-init-variant", "code", "--ds-init-alpha", "0.5"]),
    ("matt-self-attn", "dsinit_matt_iwslt_de_en", ["--matt-self-branch", "self-attn"]),
    ("matt-gated-noshare", "dsinit_matt_iwslt_de_en", ["--matt-self-branch", "gated-aan", "--no-matt-share-v"]),
    ("matt-preln-sdpa", "matt_iwslt_de_en",
     ["--encoder-normalize-before", "--decoder-normalize-before", "--attention-impl", "sdpa"]),
    ("matt-smallinit", "matt_iwslt_de_en", ["--init-scheme", "smallinit", "--no-matt-share-v"]),
    ("matt-deepnorm-torchscale", "matt_iwslt_de_en",
     ["--init-scheme", "deepnorm", "--deepnorm-variant", "torchscale", "--no-matt-share-v"]),
    ("matt-tfixup", "matt_iwslt_de_en", ["--init-scheme", "t-fixup", "--no-matt-share-v"]),
    ("matt-admin-closed", "admin_closed_iwslt_de_en", ["--decoder-layer-type", "matt"]),
    ("normformer-resids", "normformer_iwslt_de_en", ["--scale-resids"]),
    ("normformer-sdpa", "normformer_iwslt_de_en", ["--attention-impl", "sdpa", "--scale-resids"]),
    ("subln-sdpa", "subln_iwslt_de_en", ["--attention-impl", "sdpa"]),
    ("subln-normformer-attn", "subln_iwslt_de_en", ["--scale-attn", "--scale-heads"]),
    ("b2t-no-rescale", "b2t_iwslt_de_en", ["--b2t-init-rescale", "none"]),
    ("admin-closed-o1-frozen", "admin_closed_iwslt_de_en", ["--admin-output-change", "O(1)", "--admin-freeze-omega"]),
    ("admin-paper-lipschitz", "admin_iwslt_de_en", ["--init-scheme", "lipschitz", "--residual-scale", "admin"]),
    ("rezero-preln-layer", "rezero_postln_iwslt_de_en", ["--init-scheme", "xavier", "--residual-scale", "rezero",
                                                          "--encoder-normalize-before", "--decoder-normalize-before"]),
    ("twt-untied-rmsnorm", "twt_iwslt_de_en", ["--norm-type", "rmsnorm", "--share-all-embeddings"]),
    ("derf-postln-lnemb", "postln_iwslt_de_en", ["--norm-type", "derf", "--layernorm-embedding",
                                                 "--derf-embed-scale", "learnable"]),
]  # fmt: skip
LM_VARIANTS = [
    ("preln-sdpa", "preln_lm_tiny", ["--attention-impl", "sdpa"]),
    ("normformer-resids", "normformer_lm_tiny", ["--scale-resids"]),
    ("deepnorm-torchscale-fairseq", "deepnorm_torchscale_lm_tiny", []),
    ("subln-sdpa", "subln_lm_tiny", ["--attention-impl", "sdpa"]),
    ("lipschitz-bias-free", "lipschitz_lm_tiny", ["--lipschitz-bias-free"]),
    ("postln-checkpoint", "postln_lm_tiny", ["--checkpoint-activations"]),
    ("dyt-llama", "dyt_lm_tiny", ["--dyt-alpha-init", "llama2_7b", "--no-dyt-bias"]),
]


def cases() -> list:
    """``(case name, "mt" | "lm", arch, flags)`` for every family and variant, in a fixed order."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    import fairseq_deepinit  # noqa: F401  (registers the families)

    out = []
    mt = sorted(a[: -len("_iwslt_de_en")] for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m == "deepinit"
                and a.endswith("_iwslt_de_en") and not a.endswith("_12l"))  # fmt: skip
    lm = sorted(a[: -len("_lm_tiny")] for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m == "deepinit_lm"
                and a.endswith("_lm_tiny") and a != "deepinit_lm_tiny")  # fmt: skip
    out += [(f"mt-{f}", "mt", f"{f}_iwslt_de_en", []) for f in mt]
    out += [(f"mt-{n}", "mt", a, flags) for n, a, flags in MT_VARIANTS]
    out += [(f"lm-{f}", "lm", f"{f}_lm_tiny", []) for f in lm]
    out += [(f"lm-{n}", "lm", a, flags) for n, a, flags in LM_VARIANTS]
    return out


def _dictionary():
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(N_SYMBOLS):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=8)
    return d


def build(kind: str, arch: str, flags: list):
    """The model as fairseq-train builds it (seeded), and the task's dictionary."""
    from fairseq import options, tasks

    import fairseq_deepinit  # noqa: F401

    task_name = "translation" if kind == "mt" else "language_modeling"
    argv = ["/nonexistent", "--task", task_name, "--arch", arch, *(TINY_MT if kind == "mt" else TINY_LM), *flags]
    if kind == "mt":
        argv += ["-s", "src", "-t", "tgt"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    d = _dictionary()
    task = tasks.TASK_REGISTRY[task_name](args, d, d)
    torch.manual_seed(1)
    return task.build_model(args), d


def batch(kind: str, d) -> dict:
    """A fixed padded batch: left-padded sources (fairseq's default), right-padded targets."""
    g = torch.Generator().manual_seed(0)
    pad = d.pad()
    tgt = torch.randint(4, 4 + N_SYMBOLS, (3, 6), generator=g)
    tgt[1, 4:] = pad
    tgt[2, 5:] = pad
    if kind == "lm":
        return {"src_tokens": tgt, "src_lengths": tgt.ne(pad).sum(1)}
    src = torch.randint(4, 4 + N_SYMBOLS, (3, 7), generator=g)
    src[0, :2] = pad
    src[2, :1] = pad
    return {"src_tokens": src, "src_lengths": src.ne(pad).sum(1), "prev_output_tokens": tgt}


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
        else:
            t = t.detach().contiguous().cpu()
            h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:24]


def _names_digest(names) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:24]


def measure(kind: str, arch: str, flags: list) -> dict:
    """Order and output digests of one case (see the module docstring)."""
    model, d = build(kind, arch, flags)
    net = batch(kind, d)
    state_keys = list(model.state_dict())
    params = list(model.named_parameters())
    out: dict = {
        "state_keys": _names_digest(state_keys),
        "n_state_keys": len(state_keys),
        "params": _names_digest([f"{n}:{p.requires_grad}" for n, p in params]),
        "n_params": len(params),
    }
    torch.manual_seed(123)
    model.train()
    logits = model(**net)[0]
    target = torch.arange(logits.numel() // logits.size(-1)).remainder(logits.size(-1)).view(logits.shape[:-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))
    loss.backward()
    grads = [p.grad for _, p in params]
    out["train_logits"] = _digest([logits])
    out["grads"] = _digest(grads)
    out["loss"] = loss.item().hex()
    out["grad_norm"] = float(torch.stack([g.norm() for g in grads if g is not None]).norm()).hex()
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = _digest([model(**net)[0]])
        state: dict = {}
        prev = net["prev_output_tokens"] if kind == "mt" else net["src_tokens"]
        enc = model.encoder(net["src_tokens"], src_lengths=net["src_lengths"]) if kind == "mt" else None
        steps = []
        for t in range(1, 4):
            steps.append(model.decoder(prev[:, :t], encoder_out=enc, incremental_state=state)[0])
        out["incremental"] = _digest(steps)
    return out


OUTPUT_KEYS = ("train_logits", "grads", "loss", "grad_norm", "eval_logits", "incremental")


def cpu_vendor() -> str:
    """The CPU's vendor (``GenuineIntel``, ``AuthenticAMD``): MKL's kernels differ by vendor at one vector width."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def platform() -> dict:
    """What the output digests depend on besides the code."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_vendor": cpu_vendor(),
        "aten_env": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "mkl_env": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
    }


def platform_key(p: dict) -> str:
    return json.dumps(p, sort_keys=True)


def recorded_outputs(fixture: dict) -> dict:
    """``case -> output digests`` the fixture holds for this platform (empty: none recorded here)."""
    return fixture.get("outputs", {}).get(platform_key(platform()), {})


def compute_all() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: measure(kind, arch, flags) for name, kind, arch, flags in cases()}
    finally:
        torch.set_num_threads(threads)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--write", action="store_true", help=f"write {FIXTURE}")
    parser.add_argument("--dump", metavar="FILE", help="also write every case's full key and parameter lists")
    args = parser.parse_args(argv)
    values = compute_all()
    if args.dump:
        full = {}
        for name, kind, arch, flags in cases():
            model, _ = build(kind, arch, flags)
            full[name] = {"state": list(model.state_dict()), "params": [n for n, _ in model.named_parameters()]}
        Path(args.dump).write_text(json.dumps(full, indent=1))
    if args.write:
        old = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
        outputs = old.get("outputs", {})
        outputs[platform_key(platform())] = {n: {k: v[k] for k in OUTPUT_KEYS} for n, v in values.items()}
        cases_ = {n: {k: v for k, v in value.items() if k not in OUTPUT_KEYS} for n, value in values.items()}
        fixture = {"cases": cases_, "outputs": outputs}
        FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(values)} cases to {FIXTURE} ({len(outputs)} platforms' outputs)")
    else:
        print(json.dumps(values, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
