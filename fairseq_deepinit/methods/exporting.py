"""What an exporter needs to know about a method or a selector value: the :class:`Export` declaration.

A record (:class:`~.record.Method`) and each selector value it adds (``--residual-scale``'s
:class:`~.record.ResidualScaling`, ``--decoder-layer-type``'s :class:`~.record.LayerType`), and each plain
``--norm-type`` (:data:`fairseq_deepinit.axes.NORM_EXPORTS`), declare in its ``export`` field:

- ``neither``: why no target can carry it (a feature no exported architecture has): a sentence, or a
  function ``(p, spec, args) -> sentence or None`` where the answer depends on the values (``p``: the
  resolved options of the method that declares it, ``spec``: the :class:`~fairseq_deepinit.spec.ModelSpec`,
  ``args``: fairseq's own model arguments, for what only fairseq knows, such as the attention heads);
- ``refuses``: per target (:data:`TARGETS`), why that target cannot carry it, likewise; a target it does not
  name carries it;
- ``fold``: the one line of how its constants fold into stock weights (the export's log line and
  docs/export.md's table), a sentence or a function like ``refuses``'; ``steps``: the fold steps that carry it
  out, named by :data:`FOLD_STEPS` (the exporter runs every step a model's declarations name, in that order);
- ``head_norm``: ``(p, spec, args) -> HeadNorm or None``: the per-head q/k norm of the self-attentions that a
  target must reproduce (CTranslate2's ``q_norm`` / ``k_norm``).

:data:`EXPORT_NEUTRAL` declares that a method changes nothing an export carries (an init scheme, profiling,
a training-time loss or clip) or only through the selector values it declares. A record whose ``export`` is
left ``None`` has not been taught to any exporter: a model using it is refused, naming its option
(:func:`fairseq_deepinit.export.route.classify`), so a new method is never exported by accident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Tuple

FAIRSEQ = "fairseq"  # a stock fairseq ``transformer`` / ``transformer_lm`` checkpoint
CTRANSLATE2 = "ctranslate2"  # CTranslate2's ``TransformerSpec``
HUGGINGFACE = "huggingface"  # transformers' FSMT, M2M100 or XGLM: reached through the stock fairseq model
TARGETS = (FAIRSEQ, CTRANSLATE2, HUGGINGFACE)

#: the fold steps of :func:`fairseq_deepinit.export.fold.plain_state_dict`, in the order it runs them
FOLD_STEPS = (
    "scalenorm-as-rms",  # ScaleNorm g x / sqrt(||x||^2 + eps^2) as the RMSNorm of weight g / sqrt(d)
    "zero-centred-gain",  # a zero-centred RMSNorm's gain 1 + w as a plain RMSNorm weight
    "unit-rows",  # FixNorm's embedding rows as used, w / max(||w||, eps), and its tied output layer
    "constant-omega",  # a constant residual alpha (DeepNorm) written as Admin's omega vector
    "omega",  # LN(x * w + f(x)) -> LN'(x' + f'(x')): Liu et al. 2020 appendix C
    "branch-scalar",  # x + a f(x): a into the branch's last projection, weight and bias
    "input-scale",  # a Pre-LN norm's output times a constant: into its gain and bias
    "zero-biases",  # a bias-free projection's zero bias written back (stock layers have biases)
)

Why = str | Callable[[Any, Any, Any], str | None]


@dataclass(frozen=True)
class HeadNorm:
    """A per-head norm of the self-attentions' queries and keys as a target computes it: ``kind``
    ``rmsnorm`` or ``layernorm``, with ``eps``; ``scalenorm``: the plugin's ScaleNorm, written as the RMSNorm
    of weight ``g / sqrt(head_dim)`` and eps ``eps^2 / head_dim``."""

    kind: str
    eps: float
    scalenorm: bool


@dataclass(frozen=True)
class Export:
    """The declaration (see the module docstring)."""

    neither: Why = ""
    refuses: Mapping[str, Why] = field(default_factory=dict)
    fold: Why = ""
    steps: Tuple[str, ...] = ()
    head_norm: Callable[[Any, Any, Any], HeadNorm | None] | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in FOLD_STEPS] + [t for t in self.refuses if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown export targets or fold steps: {', '.join(unknown)}")

    def never(self, p: Any, spec: Any, args: Any) -> str:
        """Why no target carries this model ("": some may)."""
        return _say(self.neither, p, spec, args)

    def reasons(self, p: Any, spec: Any, args: Any) -> Dict[str, str]:
        """Per target, why it cannot carry this model (absent: it can)."""
        out = {target: _say(why, p, spec, args) for target, why in self.refuses.items()}
        return {target: reason for target, reason in out.items() if reason}

    def fold_line(self, p: Any, spec: Any, args: Any) -> str:
        """What :attr:`fold` says for this model ("" when nothing is folded)."""
        return _say(self.fold, p, spec, args)


def _say(why: Why, p: Any, spec: Any, args: Any) -> str:
    return (why(p, spec, args) if callable(why) else why) or ""


#: changes nothing an export carries (init only, profiling, training only), or only through its selector values
EXPORT_NEUTRAL = Export()


def never(why: Why) -> Export:
    """No target carries it, for the reason ``why``."""
    return Export(neither=why)


def folds(line: Why, *steps: str) -> Export:
    """Both targets carry it once ``steps`` fold its constants into the weights (``line``: what is folded)."""
    return Export(fold=line, steps=steps)
