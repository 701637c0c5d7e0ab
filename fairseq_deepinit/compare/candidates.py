"""The candidates ``deepinit-compare`` can train, and what the data-bin says about the task.

A candidate is one family of the plugin (``--arch <family>_<size>``, :mod:`fairseq_deepinit.architectures`,
:mod:`fairseq_deepinit.lm.architectures`) plus the options that select it, applied at
``--encoder-layers N --decoder-layers N`` (translation) or ``--decoder-layers N`` (a language model);
every other option is the user's. The default list covers the axes of docs/schemes.md: norm position
(Post-LN, Pre-LN), residual scaling (Admin, DeepNorm, B2T), no norm (T-Fixup), norm type (TwT's
ScaleNorm + FixNorm) and the residual stream's width (hyper-connections).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..errors import DeepInitConfigError
from ..family_args import family_spec
from ..methods import training_task


@dataclass(frozen=True)
class Candidate:
    """``label`` (the tables'), the family of its ``--arch`` and the options that select it."""

    label: str
    family: str
    flags: Tuple[str, ...] = ()


CANDIDATES: Dict[str, Candidate] = {
    "postln": Candidate("Post-LN", "postln"),
    "preln": Candidate("Pre-LN", "preln"),
    "admin": Candidate("Admin", "admin"),
    "admin_closed": Candidate("Admin closed-form (admin-torch)", "admin_closed"),
    "deepnorm": Candidate("DeepNorm", "deepnorm"),
    "tfixup": Candidate("T-Fixup (no LN)", "tfixup"),
    "twt": Candidate("PreNorm+ScaleNorm+FixNorm (TwT)", "twt"),
    "b2t": Candidate("B2T connection", "b2t"),
    "hc": Candidate("Hyper-connections (n 4, dynamic)", "hc"),
    "mhc": Candidate("mHC (n 4, Sinkhorn 20)", "mhc"),
    "dsinit": Candidate("DS-Init", "dsinit"),
    "lipschitz": Candidate("Lipschitz Post-LN", "lipschitz"),
    "subln": Candidate("Sub-LN (Magneto)", "subln"),
    "normformer": Candidate("NormFormer", "normformer"),
    "lnscale": Candidate("LayerNorm Scaling", "lnscale"),
    "qknorm": Candidate("QK-Norm (per head, RMSNorm)", "qknorm"),
    "completep": Candidate("CompleteP (branch x (L/6)^-1)", "completep"),
    "attnres": Candidate("Attention Residuals (full)", "attnres"),
    "blockattnres": Candidate("Block Attention Residuals", "blockattnres"),
}
DEFAULT = ("postln", "preln", "admin", "deepnorm", "tfixup", "twt", "b2t", "hc")

TRANSLATION, LM = "translation", "language_modeling"
# the user's --task, of those its data handling is fairseq's translation / language-modeling one (a candidate's
# records may set another of the same data handling: Admin's profiling tasks)
TASKS = ("translation", "translation_deepinit", LM)
DEFAULT_SIZE = {TRANSLATION: "iwslt_de_en", LM: "lm"}


def parse_methods(text: str) -> List[str]:
    """The names of ``--methods a,b,c`` (each known, none twice)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise DeepInitConfigError(f"--methods {text!r} names no method; choose from {', '.join(CANDIDATES)}")
    for m in names:
        if m not in CANDIDATES:
            raise DeepInitConfigError(f"unknown method {m!r} in --methods; choose from {', '.join(CANDIDATES)}")
    if len(set(names)) < len(names):
        raise DeepInitConfigError(f"--methods {text!r} names a method twice")
    return names


@dataclass(frozen=True)
class Task:
    """What the data-bin holds: ``kind`` (translation or language_modeling), the language pair, the
    target dictionary and the validation target's prefix (for the unigram threshold)."""

    kind: str
    source: str | None
    target: str | None

    def target_dict(self, data: Path) -> Path:
        return data / ("dict.txt" if self.kind == LM else f"dict.{self.target}.txt")

    def prefix(self, data: Path, split: str) -> Path:
        if self.kind == LM:
            return data / split
        return data / f"{split}.{self.source}-{self.target}.{self.target}"


def detect_task(data: Path, user_task: str | None, source: str | None, target: str | None) -> Task:
    """The task of ``data``: the user's ``--task`` if given, else a single ``dict.txt`` (a language
    model) or ``dict.SRC.txt`` / ``dict.TGT.txt`` with ``train.SRC-TGT.*`` files (translation)."""
    pairs = sorted({p.name.split(".")[1] for p in data.glob("train.*-*.*.idx")})
    kind = user_task
    if kind is None:
        if (data / "dict.txt").exists() and not pairs:
            kind = LM
        elif pairs:
            kind = TRANSLATION
        else:
            raise DeepInitConfigError(
                f"{data} holds neither dict.txt (a language model's data-bin) nor train.SRC-TGT.* files (a "
                f"translation data-bin); give a fairseq-preprocess output folder"
            )
    if kind not in TASKS:
        raise DeepInitConfigError(f"--task {kind}: deepinit-compare trains {', '.join(TASKS)}; drop --task")
    if kind == LM:
        return Task(LM, None, None)
    if source is None or target is None:
        if len(pairs) != 1:
            found = ", ".join(pairs) or "none"
            raise DeepInitConfigError(
                f"{data}: cannot tell the language pair (train.SRC-TGT.* pairs: {found}); add --source-lang "
                f"and --target-lang to the fairseq-train arguments"
            )
        s, t = pairs[0].split("-", 1)
        source, target = source or s, target or t
    return Task(TRANSLATION, source, target)


def required_task(name: str, task: Task, size: str) -> str | None:
    """The ``--task`` candidate ``name`` trains under by its records (:func:`fairseq_deepinit.methods.training_task`
    of its spec at ``size``: Admin's profiling task while omega is profiled), None: the user's."""
    c = CANDIDATES[name]
    return training_task(family_spec(c.family, c.flags, lm=task.kind == LM, size=size))


def method_flags(name: str, task: Task, user_task: str | None, size: str) -> List[str]:
    """The options that select candidate ``name`` for ``task``: its ``--arch``, and the task its records
    require (:func:`required_task`) or a language model's."""
    c = CANDIDATES[name]
    out = ["--arch", f"{c.family}_{size}", *c.flags]
    need = required_task(name, task, size)
    if need is not None:
        out += ["--task", need]
    elif user_task is None and task.kind == LM:
        out += ["--task", LM]
    return out


def known_arch(name: str, size: str) -> bool:
    """Whether ``--arch <family of name>_<size>`` is registered (a wrong ``--size`` is refused early)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    return f"{CANDIDATES[name].family}_{size}" in ARCH_MODEL_REGISTRY


def check_sizes(names: Sequence[str], size: str) -> None:
    missing = [n for n in names if not known_arch(n, size)]
    if missing:
        raise DeepInitConfigError(
            f"--size {size}: no architecture {CANDIDATES[missing[0]].family}_{size}; use a size of "
            f"fairseq_deepinit/architectures.py (translation: iwslt_de_en, wmt_en_de, wmt_en_de_big) or "
            f"fairseq_deepinit/lm/architectures.py (lm, lm_big, lm_gpt, lm_tiny, ...)"
        )
