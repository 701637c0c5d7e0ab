"""What every part of the Multi30k matrix shares: paths, splits, the methods and their flags, the
status thresholds, the error type and the log line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict

from fairseq_deepinit.compare.verdict import BLIND_FRACTION, PLATEAU_BITS  # noqa: F401  (the shared status rules)

TEST_SETS = {"test": "test2016", "test1": "test2017"}

# method -> (label in the tables, fairseq-train flags that select it)
METHODS: Dict[str, tuple] = {
    "postln": ("Post-LN", ["--arch", "postln_iwslt_de_en"]),
    "preln": ("Pre-LN", ["--arch", "preln_iwslt_de_en"]),
    "lipschitz": ("Lipschitz Post-LN", ["--arch", "lipschitz_iwslt_de_en"]),
    "tfixup": ("T-Fixup (no LN)", ["--arch", "tfixup_iwslt_de_en"]),
    "admin": ("Admin", ["--arch", "admin_iwslt_de_en", "--task", "translation_admin"]),
    "dsinit": ("DS-Init", ["--arch", "dsinit_iwslt_de_en"]),
    "dsinit_matt": ("DS-Init+MAtt", ["--arch", "dsinit_matt_iwslt_de_en"]),
    "twt": ("PreNorm+ScaleNorm+FixNorm", ["--arch", "twt_iwslt_de_en"]),
    "deepnorm": ("DeepNorm", ["--arch", "deepnorm_iwslt_de_en"]),
    # successors; their cells are not run yet (docs/results.md)
    "admin_closed": ("Admin closed-form (admin-torch)", ["--arch", "admin_closed_iwslt_de_en"]),
    "subln": ("Sub-LN (Magneto)", ["--arch", "subln_iwslt_de_en"]),
    "b2t": ("B2T connection", ["--arch", "b2t_iwslt_de_en"]),
    "deepnorm_torchscale": ("DeepNorm (torchscale)", ["--arch", "deepnorm_torchscale_iwslt_de_en"]),
    "normformer": ("NormFormer", ["--arch", "normformer_iwslt_de_en"]),
    # the methods adopted since
    "qknorm": ("QK-Norm (per head, RMSNorm)", ["--arch", "qknorm_iwslt_de_en"]),
    "periln": ("Peri-LN", ["--arch", "periln_iwslt_de_en"]),
    "reordered": ("OLMo 2 reordered norm", ["--arch", "reordered_iwslt_de_en"]),
    "lnscale": ("LayerNorm Scaling", ["--arch", "lnscale_iwslt_de_en"]),
    "mixln": ("Mix-LN", ["--arch", "mixln_iwslt_de_en"]),
    "resi_dual": ("ResiDual", ["--arch", "resi_dual_iwslt_de_en"]),
    "dyt": ("DyT", ["--arch", "dyt_iwslt_de_en"]),
    "derf": ("Derf", ["--arch", "derf_iwslt_de_en"]),
    "depth_mup": ("depth-muP (branch x (L/6)^-1/2)", ["--arch", "depth_mup_iwslt_de_en"]),
    "completep": ("CompleteP (branch x (L/6)^-1)", ["--arch", "completep_iwslt_de_en"]),
    # the 2025-26 methods; z-loss and QK-Clip are training options, here on the Pre-LN model
    "gatedattn": ("Gated attention (headwise)", ["--arch", "gatedattn_iwslt_de_en"]),
    "sinks": ("Learned attention sinks", ["--arch", "sinks_iwslt_de_en"]),
    "valueres": ("Value residual (lambda 0.5)", ["--arch", "valueres_iwslt_de_en"]),
    "zloss": ("Pre-LN + z-loss (1e-4)", ["--arch", "preln_iwslt_de_en", "--z-loss"]),
    "qkclip": ("Pre-LN + QK-Clip (tau 100)", ["--arch", "preln_iwslt_de_en", "--qk-clip"]),
    "hc": ("Hyper-connections (n 4, dynamic)", ["--arch", "hc_iwslt_de_en"]),
    "mhc": ("mHC (n 4, Sinkhorn 20)", ["--arch", "mhc_iwslt_de_en"]),
    "attnres": ("Full Attention Residuals", ["--arch", "attnres_iwslt_de_en"]),
    "blockattnres": ("Block Attention Residuals (2 layers per block)", ["--arch", "blockattnres_iwslt_de_en"]),
    # the 2025 recipe pieces: the two soft-caps together on Pre-LN, SwiGLU at the sizes' FFN width, the zero-centred
    # RMSNorm on Pre-LN
    "softcap": (
        "Pre-LN + soft-caps (50, 30)",
        ["--arch", "preln_iwslt_de_en", "--attention-softcap", "--output-softcap"],
    ),
    "swiglu": ("SwiGLU (F as given)", ["--arch", "swiglu_iwslt_de_en"]),
    # F = 170: 3 d F + 2 F + d = 33,044 FFN parameters against the ReLU FFN's 2 d 4d + 4d + d = 33,088 at d 64
    "swiglu_eq": (
        "SwiGLU (F 170, equal parameters)",
        ["--arch", "swiglu_iwslt_de_en", "--encoder-ffn-embed-dim", "170", "--decoder-ffn-embed-dim", "170"],
    ),
    "rmsnorm": ("Pre-LN, RMSNorm", ["--arch", "preln_iwslt_de_en", "--norm-type", "rmsnorm"]),
    "zcrms": ("Pre-LN, zero-centred RMSNorm", ["--arch", "preln_iwslt_de_en", "--norm-type", "zc-rmsnorm"]),
    # the Pre-LN model trained with Muon at the set-up's lr (its AdamW part with the set-up's betas and decay)
    "muon": ("Pre-LN + Muon", ["--arch", "preln_iwslt_de_en", "--optimizer", "muon"]),
}
REGIMES = ("warmup", "nowarmup")
BLEU_RE = re.compile(r"BLEU = ([0-9.]+)")


class MatrixError(RuntimeError):
    """An expected failure (missing data, unknown cell); the message says what to do."""


def log(msg: str) -> None:
    print(f"[multi30k] {msg}", file=sys.stderr, flush=True)


def parse_cell(name: str) -> tuple:
    try:
        method, depth, regime = name.split(":")
        depth_i = int(depth)
    except ValueError:
        raise MatrixError(f"cell {name!r} is not METHOD:DEPTH:REGIME (e.g. postln:18:nowarmup)") from None
    if method not in METHODS:
        raise MatrixError(f"unknown method {method!r} in {name!r}; choose from {', '.join(METHODS)}")
    if regime not in REGIMES:
        raise MatrixError(f"unknown regime {regime!r} in {name!r}; choose from {', '.join(REGIMES)}")
    return method, depth_i, regime


def cell_name(method: str, depth: int, regime: str) -> str:
    return f"{method}:{depth}:{regime}"


def cell_dir(work: Path, name: str) -> Path:
    return work / "runs" / name.replace(":", "-")
