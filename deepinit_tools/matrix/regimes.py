"""Training regimes, cells and chunks of the converged Multi30k matrix (the GPU budget estimate:
:mod:`deepinit_tools.matrix.budget`).

**Paper regimes.** Each method trains in its paper's regime, taken from the recipe in
``examples/<paper>/`` that reproduces the paper's table (optimizer, peak lr, schedule, dropout,
label smoothing, clipping, weight decay) and from the papers' stated recipes. Two things are
adapted to Multi30k, by one rule for every method:

- *batch*: 8,192 tokens per update (``--max-tokens 8192``) for every method. The IWSLT recipes use
  2-4k tokens on one GPU, the WMT recipes (Lipschitz, DeepNorm) 32k over 4-8 GPUs; Multi30k is small
  (29,000 pairs, 549,873 target tokens, 100 updates per epoch at 8,192 tokens, 17 at 32k), so the
  WMT batch would leave too few updates per epoch, and one batch size keeps the methods comparable.
- *warm-up and decay period*: measured in **epochs of the paper's own training data**, then
  converted to Multi30k updates. The paper's updates per epoch are ≈ values for its data and
  batch (:data:`PAPER_UPDATES_PER_EPOCH`); e.g. Admin warms up 6,000 updates on IWSLT14 at 4,096
  tokens (≈ 1,100 updates per epoch) = 5.5 epochs = 550 Multi30k updates at 8,192 tokens.

The peak learning rate is the paper's (not rescaled for the larger batch: inverse-sqrt recipes are
robust to 2x batch, and the point is each paper's own setting). A regime that a paper says its
method does not need is run both ways: T-Fixup without warm-up (its claim) and with; TwT with
warm-up (its main table) and without (its no-warm-up rows).

**Common regime.** fairseq's ``transformer_iwslt_de_en`` recipe, the baseline every paper starts
from: Adam (0.9, 0.98), peak lr 5e-4, inverse-sqrt after a warm-up of 4,000 IWSLT updates
(3.6 epochs), dropout 0.3, label smoothing 0.1, weight decay 1e-4, no clipping
(``examples/dsinit/iwslt14_de_en.sh`` row ``base-6l``). DS-Init's paper regime *is* this recipe, so
its common cells are its paper cells (:func:`canonical_regime`).

**Model.** ``<method>_iwslt_de_en`` at d=256, FFN 1024, 4 heads: IWSLT-small's FFN and heads at half
its width. Multi30k (29k pairs) is 5x smaller than IWSLT14, for which d=512 is already the "small"
model; d=256 keeps the 36+36-layer cells (about 66M parameters) within the budget of
:func:`deepinit_tools.matrix.budget.estimate_chunk`, and every method gets the same width. ``--dim 512``
runs the IWSLT-small width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

# updates per epoch of each paper's data at its batch (≈; sizes of the prepared corpora):
# IWSLT14 de-en 160k pairs, IWSLT15 en-vi 133k pairs, WMT14 en-de 4.5M, WMT17 en-de 5.9M pairs
PAPER_UPDATES_PER_EPOCH: Dict[str, int] = {
    "iwslt14@4096": 1100,  # examples/admin, examples/dsinit, examples/tfixup (4,000 tokens)
    "iwslt15@2048": 1800,  # examples/twt
    "wmt14@8x4096": 4200,  # examples/lipschitz (8 GPUs)
    "wmt17@4x8192": 5400,  # examples/deepnorm (4 GPUs)
}
# Multi30k de-en, joint BPE 8000 (``multi30k_matrix.py prepare``): fairseq batches per epoch, measured
# with fairseq's batch_by_size on the binarised training set
M30K_TARGET_TOKENS = 549_873
M30K_UPDATES_PER_EPOCH: Dict[int, int] = {2048: 353, 4096: 184, 8192: 100, 16384: 58}
MAX_TOKENS = 8192

STOP_MIN_LR = 5e-5  # examples/twt/iwslt15_en_vi.sh --stop-min-lr (TwT's plateau schedule ends there)
# fairseq-train stops before an epoch whose learning rate is <= --stop-min-lr (fairseq_cli/train.py:196),
# the first one included: a warm-up of the plateau schedule starts just above that floor, not at 1e-7
# (from 1e-7 it would train 0 updates)
WARMUP_INIT_LR = {"reduce_lr_on_plateau": 1.2 * STOP_MIN_LR}
DEFAULT_WARMUP_INIT_LR = 1e-7


def updates_per_epoch(max_tokens: int) -> int:
    """Multi30k updates per epoch at ``max_tokens`` (measured values, else proportional)."""
    if max_tokens in M30K_UPDATES_PER_EPOCH:
        return M30K_UPDATES_PER_EPOCH[max_tokens]
    return max(1, round(M30K_UPDATES_PER_EPOCH[8192] * 8192 / max_tokens))


@dataclass(frozen=True)
class Regime:
    """One training regime: what fairseq-train is told besides the architecture and the data.

    ``warmup_epochs`` / ``decay_epochs`` are in epochs (converted with :func:`updates_per_epoch`);
    ``warmup_epochs == 0`` means no warm-up. ``source`` says where every number comes from."""

    label: str
    source: str
    optimizer: str = "adam"
    lr: float = 5e-4
    scheduler: str = "inverse_sqrt"  # inverse_sqrt | tfixup | reduce_lr_on_plateau
    warmup_epochs: float = 0.0
    decay_epochs: float = 0.0  # tfixup: the decay period P
    dropout: float = 0.3
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    weight_decay: float = 0.0
    max_tokens: int = MAX_TOKENS
    extra: Tuple[str, ...] = field(default_factory=tuple)

    def warmup_updates(self, max_tokens: int | None = None) -> int:
        return round(self.warmup_epochs * updates_per_epoch(max_tokens or self.max_tokens))

    def flags(self, max_tokens: int | None = None) -> List[str]:
        """fairseq-train flags of this regime (optimizer, schedule, regularisation; no batch flags)."""
        f = ["--optimizer", self.optimizer, "--adam-betas", "(0.9, 0.98)", "--lr", f"{self.lr:g}"]
        f += ["--lr-scheduler", self.scheduler]
        warm = self.warmup_updates(max_tokens)
        if self.scheduler == "tfixup":
            f += ["--decay-period", str(round(self.decay_epochs * updates_per_epoch(max_tokens or self.max_tokens)))]
        if warm:
            init = WARMUP_INIT_LR.get(self.scheduler, DEFAULT_WARMUP_INIT_LR)
            f += ["--warmup-updates", str(warm), "--warmup-init-lr", f"{init:g}"]
        f += ["--dropout", f"{self.dropout:g}"]
        if self.attention_dropout:
            f += ["--attention-dropout", f"{self.attention_dropout:g}"]
        if self.activation_dropout:
            f += ["--activation-dropout", f"{self.activation_dropout:g}"]
        f += ["--label-smoothing", f"{self.label_smoothing:g}", "--clip-norm", f"{self.clip_norm:g}"]
        f += ["--weight-decay", f"{self.weight_decay:g}"]
        return f + list(self.extra)

    def summary(self, max_tokens: int | None = None) -> str:
        """One line for docs/results.md: optimizer, lr, warm-up, schedule, dropout, ls, clip, wd, batch."""
        mt = max_tokens or self.max_tokens
        sched = {
            "inverse_sqrt": "inverse-sqrt decay",
            "tfixup": f"lr·sqrt(P/(P+t)), P = {round(self.decay_epochs * updates_per_epoch(mt))}",
            "reduce_lr_on_plateau": "x0.8 when dev loss stalls 3 epochs",
        }[self.scheduler]
        warm = (
            f"warm-up {self.warmup_updates(mt)} updates ({self.warmup_epochs:g} epochs)"
            if self.warmup_epochs
            else "no warm-up"
        )
        drop = f"dropout {self.dropout:g}"
        if self.attention_dropout or self.activation_dropout:
            drop += f" (attention {self.attention_dropout:g}, activation {self.activation_dropout:g})"
        return (
            f"{'RAdam' if self.optimizer == 'radam' else 'Adam'} (0.9, 0.98), peak lr {self.lr:g}, "
            f"{warm}, {sched}, {drop}, label smoothing {self.label_smoothing:g}, "
            f"clip {self.clip_norm:g}, weight decay {self.weight_decay:g}, {mt} tokens/update"
        )


def _epochs(warmup_updates: int, key: str) -> float:
    """A paper's warm-up (or decay period) in epochs of its data, to one decimal."""
    return round(warmup_updates / PAPER_UPDATES_PER_EPOCH[key], 1)


# examples/dsinit/iwslt14_de_en.sh (row base-6l): fairseq's IWSLT14 transformer recipe
COMMON = Regime(
    "common: fairseq IWSLT recipe",
    "examples/dsinit/iwslt14_de_en.sh TRAIN_ARGS (fairseq transformer_iwslt_de_en recipe)",
    lr=5e-4,
    warmup_epochs=_epochs(4000, "iwslt14@4096"),
    dropout=0.3,
    weight_decay=1e-4,
)
# examples/admin/_iwslt14.sh; METHODS.md "Recipe IWSLT: ... RAdam (0.9,0.98) lr 7e-4, inverse_sqrt warmup 6000,
# dropout 0.3, wd 1e-4, max-tokens 4096" (Liu et al. 2020, Table 2: Post-LN, Pre-LN and Admin rows)
ADMIN = Regime(
    "Liu et al. 2020 IWSLT14 (Table 2)",
    "examples/admin/_iwslt14.sh; METHODS.md Admin 'Recipe IWSLT'",
    optimizer="radam",
    lr=7e-4,
    warmup_epochs=_epochs(6000, "iwslt14@4096"),
    dropout=0.3,
    attention_dropout=0.1,
    activation_dropout=0.1,
    weight_decay=1e-4,
)
# examples/lipschitz/_wmt14.sh (Xu et al. 2020, Table 3, WMT14 en-de on 8 GPUs)
LIPSCHITZ = Regime(
    "Xu et al. 2020 WMT14 (Table 3)",
    "examples/lipschitz/_wmt14.sh",
    lr=7e-4,
    warmup_epochs=_epochs(4000, "wmt14@8x4096"),
    dropout=0.1,
)
# examples/tfixup/_iwslt14.sh NO_WARMUP; METHODS.md T-Fixup: "train with no warmup: lr_t = lr * sqrt(P / (P + t)),
# P = 4000"; "Released script: lr 5e-4, dropout 0.5 (!), wd 1e-4, max-tokens 4000"
TFIXUP = Regime(
    "Huang et al. 2020 IWSLT14, no warm-up",
    "examples/tfixup/_iwslt14.sh NO_WARMUP; METHODS.md T-Fixup 'Released script'",
    lr=5e-4,
    scheduler="tfixup",
    decay_epochs=_epochs(4000, "iwslt14@4096"),
    dropout=0.5,
    weight_decay=1e-4,
)
# examples/tfixup/_iwslt14.sh WARMUP: the same with inverse_sqrt warm-up 4000 (what T-Fixup says it does not need)
TFIXUP_WARMUP = Regime(
    "Huang et al. 2020 IWSLT14, with warm-up",
    "examples/tfixup/_iwslt14.sh WARMUP",
    lr=5e-4,
    warmup_epochs=_epochs(4000, "iwslt14@4096"),
    dropout=0.5,
    weight_decay=1e-4,
)
# examples/dsinit/iwslt14_de_en.sh (Zhang et al. 2019, IWSLT14 rows dsinit-12l, dsinit-matt-12l)
DSINIT = COMMON
# examples/twt/iwslt15_en_vi.sh WARMUP (Nguyen & Salazar 2019, Table 1): warm-up 8000 then x0.8 on plateau, clip 1
TWT = Regime(
    "Nguyen & Salazar 2019 IWSLT15 (Table 1)",
    "examples/twt/iwslt15_en_vi.sh WARMUP; METHODS.md TwT 'validation-based decay'",
    lr=5e-4,
    scheduler="reduce_lr_on_plateau",
    warmup_epochs=_epochs(8000, "iwslt15@2048"),
    dropout=0.3,
    attention_dropout=0.3,
    activation_dropout=0.3,
    clip_norm=1.0,
    extra=("--lr-shrink", "0.8", "--lr-patience", "3"),
)
# examples/twt/iwslt15_en_vi.sh NO_WARMUP (Table 5 rows without warm-up): lr 3e-4 from the first update
TWT_NOWARMUP = Regime(
    "Nguyen & Salazar 2019, no warm-up",
    "examples/twt/iwslt15_en_vi.sh NO_WARMUP; METHODS.md TwT 'no-warmup lr 3e-4'",
    lr=3e-4,
    scheduler="reduce_lr_on_plateau",
    dropout=0.3,
    attention_dropout=0.3,
    activation_dropout=0.3,
    clip_norm=1.0,
    extra=("--lr-shrink", "0.8", "--lr-patience", "3"),
)
# examples/deepnorm/table1_wmt17_en_de.sh (Wang et al. 2022, Table 1, WMT17 en-de on 4 GPUs)
DEEPNORM = Regime(
    "Wang et al. 2022 WMT17 (Table 1)",
    "examples/deepnorm/table1_wmt17_en_de.sh",
    optimizer="radam",
    lr=1e-3,
    warmup_epochs=_epochs(8000, "wmt17@4x8192"),
    dropout=0.1,
    attention_dropout=0.1,
    activation_dropout=0.1,
)

# method -> {regime name: regime}; "paper" is the method's main paper regime, other names are the
# variants run "both ways"; "common" is added for every method
PAPER_REGIMES: Dict[str, Dict[str, Regime]] = {
    "postln": {"paper": ADMIN},
    "preln": {"paper": ADMIN},
    "lipschitz": {"paper": LIPSCHITZ},
    "tfixup": {"paper": TFIXUP, "paper-warmup": TFIXUP_WARMUP},
    "admin": {"paper": ADMIN},
    "dsinit": {"paper": DSINIT},
    "dsinit_matt": {"paper": DSINIT},
    "twt": {"paper": TWT, "paper-nowarmup": TWT_NOWARMUP},
    "deepnorm": {"paper": DEEPNORM},
    # successors: none of their papers has an IWSLT/Multi30k recipe, so "paper" is the
    # regime of the method each one is compared with (Admin's for the Post-LN ones and NormFormer,
    # DeepNet's for torchscale's two); not run yet (docs/results.md)
    "admin_closed": {"paper": ADMIN},
    "subln": {"paper": DEEPNORM},
    "b2t": {"paper": ADMIN},
    "deepnorm_torchscale": {"paper": DEEPNORM},
    "normformer": {"paper": ADMIN},
}
METHODS: Tuple[str, ...] = tuple(PAPER_REGIMES)
# the papers' methods and their successors, which get chunks of
# their own so that the papers' chunks keep their size and GPU budget
SUCCESSOR_METHODS: Tuple[str, ...] = ("admin_closed", "subln", "b2t", "deepnorm_torchscale", "normformer")
MAIN_METHODS: Tuple[str, ...] = tuple(m for m in METHODS if m not in SUCCESSOR_METHODS)
# methods whose papers claim very deep training (T-Fixup 200 layers, Admin 60+12, DeepNorm 1000) and the
# Pre-LN baseline: the 100-layer cells
VERY_DEEP = ("preln", "tfixup", "admin", "deepnorm")


def regimes_of(method: str) -> Dict[str, Regime]:
    """Every regime name of ``method``: its paper regime(s) and ``common``."""
    return {**PAPER_REGIMES[method], "common": COMMON}


def canonical_regime(method: str, regime: str) -> str:
    """The regime a cell actually trains: ``common`` is ``paper`` where the two are the same regime."""
    if regime == "common" and PAPER_REGIMES[method]["paper"] is COMMON:
        return "paper"
    return regime


@dataclass(frozen=True, order=True)
class Cell:
    """One training run: method, layers per stack, regime name, seed."""

    depth: int
    method: str
    regime: str
    seed: int = 1

    @property
    def name(self) -> str:
        return f"{self.method}:{self.depth}:{self.regime}:s{self.seed}"

    @property
    def dirname(self) -> str:
        return self.name.replace(":", "-")

    @property
    def spec(self) -> Regime:
        return regimes_of(self.method)[self.regime]

    @classmethod
    def parse(cls, name: str) -> Cell:
        """``METHOD:DEPTH:REGIME[:sSEED]`` -> Cell; ValueError with what to write instead."""
        parts = name.split(":")
        if len(parts) not in (3, 4) or not parts[1].isdigit() or (len(parts) == 4 and not parts[3][1:].isdigit()):
            raise ValueError(f"cell {name!r} is not METHOD:DEPTH:REGIME[:sSEED] (e.g. tfixup:18:paper:s2)")
        method, depth, regime = parts[0], int(parts[1]), parts[2]
        if method not in PAPER_REGIMES:
            raise ValueError(f"unknown method {method!r} in {name!r}; choose from {', '.join(METHODS)}")
        if regime not in regimes_of(method):
            raise ValueError(f"{method} has no regime {regime!r}; choose from {', '.join(regimes_of(method))}")
        return cls(depth, method, canonical_regime(method, regime), int(parts[3][1:]) if len(parts) == 4 else 1)


def cells_of(depth: int, which: str, methods: Sequence[str] = MAIN_METHODS, seeds: Sequence[int] = (1,)) -> List[Cell]:
    """The cells of one depth: ``which`` = paper (every paper regime and variant), common, or both.
    Common cells that are a method's paper cell are not repeated."""
    if which not in ("paper", "common", "both"):
        raise ValueError(f"--regime {which!r}: choose paper, common or both")
    out = []
    for m in methods:
        names = [r for r in PAPER_REGIMES[m] if which in ("paper", "both")]
        if which in ("common", "both"):
            names.append("common")
        for r in names:
            for s in seeds:
                c = Cell(depth, m, canonical_regime(m, r), s)
                if c not in out:
                    out.append(c)
    return out


@dataclass(frozen=True)
class Chunk:
    """A piece of the matrix that one GPU session runs (one command, resumable)."""

    description: str
    cells: Tuple[Cell, ...]
    max_tokens_per_job: int | None = None  # memory limit per job: above it, --update-freq


def _main_seeds(depth: int, seeds: Sequence[int]) -> Tuple[Cell, ...]:
    return tuple(Cell(depth, m, "paper", s) for s in seeds for m in MAIN_METHODS)


def _half(cells: Sequence[Cell], part: int) -> Tuple[Cell, ...]:
    """Every other cell (part 0 or 1): two chunks of about equal cost."""
    return tuple(cells[part::2])


_36P = cells_of(36, "paper")
_36C = [c for c in cells_of(36, "common") if c.regime == "common"]
_100 = [Cell(100, m, "paper") for m in VERY_DEEP]
# each chunk fits one GPU session (about 20 minutes of an H100 at --jobs 4, estimate_chunk)
CHUNKS: Dict[str, Chunk] = {
    "smoke": Chunk(
        "2 cells, 2 layers: checks the set-up on the device", (Cell(2, "preln", "paper"), Cell(2, "tfixup", "paper"))
    ),
    "6l": Chunk("6 layers, every paper regime and the common one", tuple(cells_of(6, "both"))),
    "18l-paper": Chunk("18 layers, every paper regime (seed 1)", tuple(cells_of(18, "paper"))),
    "18l-common": Chunk(
        "18 layers, the common regime", tuple(c for c in cells_of(18, "common") if c.regime == "common")
    ),
    "18l-seed2": Chunk("18 layers, paper regime, seed 2", _main_seeds(18, (2,))),
    "18l-seed3": Chunk("18 layers, paper regime, seed 3", _main_seeds(18, (3,))),
    "36l-paper-a": Chunk("36 layers, paper regimes, first half", _half(_36P, 0)),
    "36l-paper-b": Chunk("36 layers, paper regimes, second half", _half(_36P, 1)),
    "36l-common-a": Chunk("36 layers, common regime, first half", _half(_36C, 0)),
    "36l-common-b": Chunk("36 layers, common regime, second half", _half(_36C, 1)),
    "100l-a": Chunk("100 layers, paper regime: Pre-LN, Admin", _half(_100, 0), max_tokens_per_job=4096),
    "100l-b": Chunk("100 layers, paper regime: T-Fixup, DeepNorm", _half(_100, 1), max_tokens_per_job=4096),
    "successors-6l": Chunk(
        "6 layers, the successors of #16 in their borrowed paper regime and the common one",
        tuple(cells_of(6, "both", SUCCESSOR_METHODS)),
    ),
    "successors-18l": Chunk(
        "18 layers, the successors of #16, paper regime", tuple(cells_of(18, "paper", SUCCESSOR_METHODS))
    ),
}
# the paper matrix in one GPU session instead of one chunk per session, in the order the verdicts
# need it (every paper regime at 6, 18 and 36 layers, then the common regime at each depth). Not a chunk: it
# spans the chunks above (which partition the matrix); `converge --chunk priority --jobs K` packs K cells at
# a time, and a command cut by its time limit resumes where it stopped.
SESSIONS: Dict[str, Chunk] = {
    "priority": Chunk(
        "6/18/36 layers, every paper regime, then the common one (one GPU session, packed)",
        (
            *cells_of(6, "paper"),
            *cells_of(18, "paper"),
            *cells_of(36, "paper"),
            *(c for d in (6, 18, 36) for c in cells_of(d, "common") if c.regime == "common"),
        ),
    )
}
