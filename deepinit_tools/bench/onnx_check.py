"""ONNX export of transformers model folders (FSMT, M2M100, XGLM): onnxruntime's logits against PyTorch's.

For each ``--model DIR`` (a folder written by ``save_pretrained``, as ``deepinit-export --to huggingface``
writes them; by default three randomly initialised ones, one per class, of ``--size`` :data:`SIZES`,
:func:`random_models`):

1. the model's teacher-forced forward (:class:`TeacherForced`: ``input_ids``, ``attention_mask`` and, for the
   encoder-decoders, ``decoder_input_ids`` -> ``logits``, ``use_cache=False``, float32) is exported with
   ``torch.onnx.export(..., dynamo=True)`` (torch.export, then onnxscript's translation), batch and lengths
   dynamic;
2. onnxruntime (CPU) runs the file on the export's batch (2 rows, source 7 tokens, target 5) and on one of
   other shapes (3 rows, 11, 6), both right-padded (:func:`batch`);
3. the largest absolute difference from the PyTorch model's own forward (``model(**inputs, use_cache=False)``,
   float32) is printed per model; exit status 1 if one exceeds ``--tolerance`` (1e-4, deepinit-export's), is
   not finite, or the export fails (its error in one line).

Why this route and not ``optimum-cli export onnx``, and why FSMT's decoder padding mask is an input of the
traced forward: docs/export.md, "ONNX". The onnx packages are pinned in requirements/onnx.txt (scripts/setup.sh
installs them); without them the script says how to install them (:data:`INSTALL`) and exits with status 1.

    OMP_NUM_THREADS=1 python benchmarks/onnx_check.py                # tiny random models (--size base)
    OMP_NUM_THREADS=1 python benchmarks/onnx_check.py --model hf-fsmt --model hf-xglm --out onnx
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from deepinit_tools.harness import report
from deepinit_tools.harness.cli import Parser, fail, positive_int

# the transformers class that deepinit-export --to huggingface writes, by config.json's model_type
CLASSES = {
    "fsmt": "FSMTForConditionalGeneration",
    "m2m_100": "M2M100ForConditionalGeneration",
    "xglm": "XGLMForCausalLM",
}
PACKAGES = (
    ("transformers", "transformers"),
    ("onnx", "onnx"),
    ("onnxscript", "onnxscript"),
    ("onnxruntime", "onnxruntime"),
)
INSTALL = "bash scripts/setup.sh (or pip install --no-deps --require-hashes -r requirements/onnx.txt)"
# FSMT builds its decoder's padding mask with `if not mask.any()` (transformers' make_padding_mask), a branch on
# the data that torch.export refuses; given the mask (decoder_input_ids != pad, what that branch computes), it
# takes the data-independent path (invert_mask). M2M100 and XGLM mask no decoder padding by default.
DECODER_PAD_MASK = frozenset({"fsmt"})
# the random models' dimensions: tiny for the tests, transformer-base for the logits' scale of a real model
SIZES = {
    "tiny": {"d_model": 32, "layers": 2, "heads": 4, "ffn": 64, "vocab": 50, "positions": 64},
    "base": {"d_model": 512, "layers": 6, "heads": 8, "ffn": 2048, "vocab": 8000, "positions": 256},
}


def require_packages() -> None:
    """Exit 1 with one line saying what to install when transformers or an onnx package is missing."""
    missing = []
    for dist, module in PACKAGES:
        try:
            __import__(module)
        except ImportError:
            missing.append(dist)
    if missing:
        fail(f"onnx_check.py needs {', '.join(missing)}, not installed: {INSTALL}")


def model_type(folder: Path) -> str:
    """config.json's ``model_type`` of a model folder; exit 1 in one line if it is not one of :data:`CLASSES`."""
    config = folder / "config.json"
    if not config.is_file():
        fail(f"{folder}: no config.json (a transformers model folder, as save_pretrained writes it)")
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        fail(f"{config}: not a JSON object")
    if kind not in CLASSES:
        fail(f"{folder}: model_type {kind!r}; this check knows {', '.join(sorted(CLASSES))}")
    return kind


def random_models(folder: Path, seed: int, size: str = "tiny") -> List[Path]:
    """Three randomly initialised models (:data:`SIZES`), one per class, saved with ``save_pretrained``."""
    import transformers as tf

    tf.utils.logging.disable_progress_bar()  # a bar per model would bury the table
    t = SIZES[size]
    special = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
    seq2seq = {
        "d_model": t["d_model"],
        "encoder_layers": t["layers"],
        "decoder_layers": t["layers"],
        "encoder_attention_heads": t["heads"],
        "decoder_attention_heads": t["heads"],
        "encoder_ffn_dim": t["ffn"],
        "decoder_ffn_dim": t["ffn"],
        "max_position_embeddings": t["positions"],
        "decoder_start_token_id": 2,
        **special,
    }
    configs = {
        "fsmt": tf.FSMTConfig(langs=["de", "en"], src_vocab_size=t["vocab"], tgt_vocab_size=t["vocab"], **seq2seq),
        "m2m_100": tf.M2M100Config(vocab_size=t["vocab"], **seq2seq),
        "xglm": tf.XGLMConfig(
            vocab_size=t["vocab"],
            d_model=t["d_model"],
            num_layers=t["layers"],
            attention_heads=t["heads"],
            ffn_dim=t["ffn"],
            max_position_embeddings=t["positions"],
            **special,
        ),
    }
    out = []
    for kind, config in configs.items():
        torch.manual_seed(seed)
        getattr(tf, CLASSES[kind])(config).save_pretrained(folder / kind)
        out.append(folder / kind)
    return out


def load(folder: Path):
    """The model of a folder, float32, in eval mode, with the class :data:`CLASSES` names for its type."""
    import transformers as tf

    cls = getattr(tf, CLASSES[model_type(folder)])
    tf.utils.logging.disable_progress_bar()
    return cls.from_pretrained(folder, dtype="float32").eval()


class TeacherForced(torch.nn.Module):
    """``logits`` of the model's teacher-forced forward, positional tensors only (what torch.onnx traces)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.seq2seq = model.config.is_encoder_decoder
        self.pad_mask = model.config.model_type in DECODER_PAD_MASK
        # the model's mode, not a new module's (training): an exporter that restores the mode it found would
        # otherwise leave the model in training mode, its dropout on
        self.train(model.training)

    def forward(self, input_ids, attention_mask, decoder_input_ids=None):
        if not self.seq2seq:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        extra = (
            {"decoder_attention_mask": decoder_input_ids.ne(self.model.config.pad_token_id)} if self.pad_mask else {}
        )
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            use_cache=False,
            **extra,
        ).logits


def batch(config, size: int, source: int, target: int, seed: int) -> Dict[str, object]:
    """Random token ids (never the special ids 0-2) of ``size`` rows, right-padded: row ``r`` ends in ``r`` pads
    (source and, for the encoder-decoders, target)."""
    g = torch.Generator().manual_seed(seed)
    pad = config.pad_token_id
    source_vocab = getattr(config, "src_vocab_size", None) or config.vocab_size
    ids = torch.randint(3, source_vocab, (size, source), generator=g)
    mask = torch.ones(size, source, dtype=torch.long)
    for row in range(1, size):
        ids[row, source - row :] = pad
        mask[row, source - row :] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if config.is_encoder_decoder:
        target_vocab = getattr(config, "tgt_vocab_size", None) or config.vocab_size
        dec = torch.randint(3, target_vocab, (size, target), generator=g)
        for row in range(1, size):
            dec[row, target - row :] = pad
        out["decoder_input_ids"] = dec
    return out


def reference_logits(model, inputs: Dict[str, object]):
    """The PyTorch model's own teacher-forced forward (its default masks; ``use_cache=False``: FSMT applies its
    causal mask only then)."""
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def export(model, inputs: Dict[str, object], path: Path) -> None:
    """``torch.onnx.export(dynamo=True)`` of :class:`TeacherForced`, batch and lengths dynamic."""
    from torch.export import Dim

    names = list(inputs)
    batch_dim, source, target = Dim("batch"), Dim("source"), Dim("target")
    dims = {
        "input_ids": {0: batch_dim, 1: source},
        "attention_mask": {0: batch_dim, 1: source},
        "decoder_input_ids": {0: batch_dim, 1: target},
    }
    # the exporter's advice (axis renaming, torchvision's ops skipped, pytree deprecations) is not the result
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                TeacherForced(model),
                tuple(inputs.values()),
                str(path),
                input_names=names,
                output_names=["logits"],
                dynamic_shapes={k: dims[k] for k in names},
                dynamo=True,
                verbose=False,
            )
    finally:
        quiet.setLevel(level)


def max_diff(session, model, inputs: Dict[str, object]) -> Tuple[float, float]:
    """(max |onnxruntime logits - PyTorch logits| over every position, max |PyTorch logit|: the scale); the
    difference is NaN if either side is not finite or the shapes differ."""
    import numpy as np

    want = reference_logits(model, inputs).numpy()
    got = session.run(["logits"], {k: v.numpy() for k, v in inputs.items()})[0]
    scale = float(np.abs(want).max())
    if got.shape != want.shape or not (np.isfinite(got).all() and np.isfinite(want).all()):
        return math.nan, scale
    return float(np.abs(got - want).max()), scale


def one_line(error: BaseException) -> str:
    """The innermost cause's type and first line (torch.onnx wraps torch.export's error in pages of advice)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def check(folder: Path, out: Path, tolerance: float, seed: int, label: str) -> dict:
    """Export one model folder and compare; a row of the table."""
    import onnxruntime

    model = load(folder)
    kind = model.config.model_type
    row = {"model": label, "class": CLASSES[kind], "attention": model.config._attn_implementation}
    example = batch(model.config, 2, 7, 5, seed)
    path = out / f"{folder.name}.onnx"
    start = time.perf_counter()
    try:
        export(model, example, path)
    except Exception as error:  # noqa: BLE001  (every failure of the exporter is the measured result)
        return {
            **row,
            "export_s": None,
            "diff_export_shapes": None,
            "diff_other_shapes": None,
            "ok": False,
            "error": one_line(error),
        }
    row["export_s"] = round(time.perf_counter() - start, 1)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    row["diff_export_shapes"], scale = max_diff(session, model, example)
    row["diff_other_shapes"], other_scale = max_diff(session, model, batch(model.config, 3, 11, 6, seed + 1))
    row["max_abs_logit"] = max(scale, other_scale)
    diffs = (row["diff_export_shapes"], row["diff_other_shapes"])
    row["ok"] = all(math.isfinite(d) and d <= tolerance for d in diffs)
    row["error"] = None if row["ok"] else f"max |diff| {diffs} above {tolerance} or not finite"
    return row


def _sci(value: float | None) -> str | None:
    return None if value is None else f"{value:.2e}"


def table(rows: Sequence[dict]) -> str:
    """One row per model: the export's seconds, the two batches' max |logit difference|, the logits' scale."""
    header = ["model", "class", "attention", "export s", "max abs diff, export's shapes",
              "max abs diff, other shapes", "max abs logit", "result"]  # fmt: skip
    cells = [
        [r["model"], r["class"], r["attention"], r["export_s"], _sci(r["diff_export_shapes"]),
         _sci(r["diff_other_shapes"]), _sci(r.get("max_abs_logit")), "ok" if r["ok"] else f"FAIL: {r['error']}"]
        for r in rows
    ]  # fmt: skip
    return report.markdown_table(header, cells, right=(3, 4, 5, 6))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="onnx_check.py", description=__doc__)
    p.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        help="a transformers model folder (repeatable; default: three random models of --size, one per class)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="folder for the <model folder name>.onnx files, replaced if there (default: a temporary folder, removed)",
    )
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest accepted max |logit difference|")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="of the random models (without --model)")
    p.add_argument("--seed", type=positive_int, default=1, help="seed of the random models and the batches")
    p.add_argument("--json", type=Path, help="write the rows and the environment here")
    return p


def versions() -> dict:
    return {dist: report.package_version(dist, module) for dist, module in PACKAGES}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        fail(f"onnx_check.py: --tolerance {args.tolerance} is not a finite number >= 0")
    for folder in args.model:
        model_type(folder)
    if len({folder.name for folder in args.model}) < len(args.model):
        fail("onnx_check.py: two --model folders of the same name would write the same <name>.onnx")
    require_packages()
    meta = {**report.environment("cpu", "onnx_check.py", argv), **versions()}
    with tempfile.TemporaryDirectory(prefix="onnx_check.") as scratch:
        out = args.out or Path(scratch) / "onnx"
        out.mkdir(parents=True, exist_ok=True)
        folders = args.model or random_models(Path(scratch) / "models", args.seed, args.size)
        labels = [str(f) if args.model else f"{args.size} {f.name} (random)" for f in folders]
        rows = [check(f, out, args.tolerance, args.seed, label) for f, label in zip(folders, labels, strict=True)]
    extra = ", ".join(f"{k} {meta[k]}" for k, _ in PACKAGES)
    print(report.provenance(meta) + f"\nPackages: {extra}\n\n" + table(rows))
    report.write_json(args.json, {"rows": rows}, meta)
    return 0 if all(r["ok"] for r in rows) else 1
