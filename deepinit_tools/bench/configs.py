"""The configurations of benchmarks/throughput.py (and of its ``--gpu-matrix``, gpu_profile.py): one row each.

A new configuration is one ``_C(...)`` row in :data:`CONFIG_LIST`: a name, the fairseq ``--arch``, its
extra flags, what it is, the stock configuration it is compared with and whether only its initial
weights differ from that one (then its speed must match it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List

from deepinit_tools.harness.fairseq_train import Shape, Variant
from deepinit_tools.harness.fairseq_train import train_argv as _train_argv


@dataclasses.dataclass(frozen=True)
class Config:
    """One model configuration: a fairseq ``--arch`` plus flags, and what it is compared against."""

    name: str
    arch: str
    flags: tuple
    what: str
    ref: str = "stock"  # the stock configuration at the same norm position
    init_only: bool = False  # same computation as ``ref``, only the initial weights differ

    @property
    def plugin(self) -> bool:
        return not self.name.startswith("stock")


PRE = ("--encoder-normalize-before", "--decoder-normalize-before")
_C = Config
CONFIG_LIST: List[Config] = [
        _C("stock", "transformer", (), "fairseq `transformer`, Post-LN, LayerNorm", ref="stock"),
        _C("stock-preln", "transformer", PRE, "fairseq `transformer`, Pre-LN, LayerNorm", ref="stock-preln"),
        _C("plugin", "deepinit", ("--init-scheme", "fairseq"), "plugin model, fairseq's own init (= stock)"),
        _C("postln", "postln_wmt_en_de", (), "Post-LN, xavier (0.8/0.9 baseline)", init_only=True),
        _C("lipschitz", "lipschitz_wmt_en_de", (), "Post-LN, Lipschitz init", init_only=True),
        _C("smallinit", "deepinit", ("--init-scheme", "smallinit"), "Post-LN, SmallInit", init_only=True),
        _C("ds-init", "dsinit_wmt_en_de", (), "Post-LN, DS-Init", init_only=True),
        _C("preln", "preln_wmt_en_de", (), "Pre-LN, LayerNorm, xavier", ref="stock-preln", init_only=True),
        _C("preln-scalenorm", "preln_wmt_en_de", ("--norm-type", "scalenorm"), "Pre-LN, ScaleNorm, xavier",
           ref="stock-preln"),
        _C("preln-rmsnorm", "preln_wmt_en_de", ("--norm-type", "rmsnorm"), "Pre-LN, RMSNorm, xavier",
           ref="stock-preln"),
        _C("preln-dyt", "dyt_wmt_en_de", (), "DyT: Pre-LN, tanh in place of every norm, xavier", ref="stock-preln"),
        _C("deepnorm", "deepnorm_wmt_en_de", (), "DeepNorm: Post-LN, alpha-scaled residual"),
        _C("resi-dual", "resi_dual_wmt_en_de", (), "ResiDual: Post-LN plus a raw stream, final norm"),
        _C("t-fixup", "tfixup_wmt_en_de", (), "T-Fixup: no norm"),
        _C("rezero", "rezero_wmt_en_de", (), "ReZero: no norm, x + a*f(x)"),
        _C("twt", "twt_wmt_en_de", (), "TwT: Pre-norm ScaleNorm + FixNorm + SmallInit, tied output", ref="stock-preln"),
        _C("lnscale", "lnscale_wmt_en_de", (), "LNS: Pre-LN, norm outputs x 1/sqrt(l)", ref="stock-preln"),
        _C("mixln", "mixln_wmt_en_de", (), "Mix-LN: first L/4 layers Post-LN, rest Pre-LN", ref="stock-preln"),
        _C("periln", "periln_wmt_en_de", (), "Peri-LN: a norm before and after each branch", ref="stock-preln"),
        _C("reordered", "reordered_wmt_en_de", (), "OLMo 2 reordered: a norm on each branch's output",
           ref="stock-preln"),
        _C("qknorm", "qknorm_wmt_en_de", (), "QK-Norm: Pre-LN + per-head RMSNorm on q, k", ref="stock-preln"),
        _C("completep", "completep_wmt_en_de", (), "CompleteP: Pre-LN, each branch x (L/6)^-1", ref="stock-preln"),
]  # fmt: skip
CONFIGS: Dict[str, Config] = {c.name: c for c in CONFIG_LIST}
TABLE_CONFIGS = tuple(n for n in CONFIGS if n != "plugin")  # the CPU table's default set
QUICK_CONFIGS = ("postln", "preln-scalenorm")
FULL_SHAPES = (Shape(6, 256, 1024, 4), Shape(18, 128, 512, 4))
QUICK_SHAPES = (Shape(2, 64, 128, 2),)
# (numerator, denominator, target ratio): ScaleNorm must be no slower than LayerNorm at the same position
NORM_COMPARISONS = (("preln-scalenorm", "preln", 1.0), ("preln-rmsnorm", "preln", None))
INIT_ONLY_TARGET = 0.98


def variant_of(opts) -> Variant:
    """The precision every configuration of the table runs in (``--fp16`` / ``--amp`` / fp32)."""
    return Variant("fp16" if opts.fp16 else "amp" if opts.amp else "fp32")


def train_argv(data: Path, cfg: Config, shape: Shape, opts) -> List[str]:
    """fairseq-train arguments of ``cfg`` (shared by the in-process builder and ``--mode cli``)."""
    return _train_argv(data, cfg.arch, cfg.flags, shape, variant_of(opts), cfg.plugin, opts)
