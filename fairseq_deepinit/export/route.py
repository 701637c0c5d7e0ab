"""Which way out a checkpoint has: the one classification of a model for ``deepinit-export``.

:func:`classify` reads the model's :class:`~fairseq_deepinit.spec.ModelSpec` (resolved from the checkpoint's
model arguments by :func:`fairseq_deepinit.resolve.resolve`, as the model's build resolves them) and the
:class:`~fairseq_deepinit.methods.exporting.Export` declarations of what the spec selects: its decoder
layer type, its residual scaling, its norm (:func:`fairseq_deepinit.axes.norm_export`) and every method
that is on. It returns a :class:`Route`: for each target, whether the model is exactly a stock fairseq
``transformer`` / ``transformer_lm`` (``stock``), becomes one by folding constants into its weights
(``fold``), is exactly expressible in CTranslate2's ``TransformerSpec`` only, or is refused, with one line
naming the feature and why. Nothing here names a method or one of its options: what a method needs is on
its record, and an option whose record declares nothing is refused (the export does not carry it yet).
What stays here is the targets' own facts (fairseq's options a target lacks, CTranslate2's one norm
epsilon, its activations). Nothing else in the export decides a route; the folds (:mod:`.fold`) and the
writers (:mod:`.to_fairseq`, :mod:`.to_ct2`) only carry out the plan it returns. docs/export.md has the table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from ..axes import AXES, all_options, norm_export
from ..errors import ExportError
from ..methods import LAYER_TYPES, METHODS, RESIDUAL_SCALINGS, declaring
from ..methods.exporting import CTRANSLATE2, FAIRSEQ, FOLD_STEPS, HUGGINGFACE, TARGETS, Export, HeadNorm
from ..methods.record import flag
from ..modules.norms import NORM_TYPES
from ..resolve import resolve
from ..spec import ModelSpec, Params
from .fairseq_args import FairseqArgs

__all__ = ["CTRANSLATE2", "FAIRSEQ", "HUGGINGFACE", "TARGETS", "QKNorm", "Route", "classify"]

QKNorm = HeadNorm  # the self-attentions' q/k norms as the writers place them

#: CTranslate2's norm eps when ``layer_norm_epsilon`` is not set: 1e-5 for LayerNorm, 1e-6 for RMSNorm
#: (src/layers/common.cc:445-453)
CT2_DEFAULT_EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6}
#: an RMSNorm that is the identity: ``x * rsqrt(mean(x^2) + 2^100) * 2^50 = x`` exactly while
#: ``mean(x^2) < 2^76`` (the eps absorbs it in fp32) and ``|x| > 2^-76`` (no subnormal); powers of two
#: make the product of the two scales exactly 1
IDENTITY_EPS = 2.0**100
IDENTITY_GAIN = 2.0**50

#: CTranslate2's activations for fairseq's --activation-fn (its converter, converters/fairseq.py:19-25)
CT2_ACTIVATIONS = {
    "relu": "RELU",
    "gelu": "GELU",
    "gelu_accurate": "GELUTanh",
    "gelu_fast": "GELUTanh",
    "swish": "SWISH",
}

#: transformers' classes that are fairseq's own computations, by (language model, placement of every stack):
#: FSMT is the Post-LN ``transformer``, M2M100 the Pre-LN one with final norms, XGLM the Pre-LN ``transformer_lm``
#: (:mod:`.to_hf`); a Hugging Face export goes through the stock fairseq model, so it carries what that carries
HF_CLASSES = {(False, "post"): "FSMT", (False, "pre"): "M2M100", (True, "pre"): "XGLM"}

#: the options whose owner declares what an export does with them: the axes (their values declare it) and
#: every option of a record with an ``export``; derived from the records (a test narrows it)
UNDERSTOOD = frozenset(
    [*AXES, *(o.name for m in METHODS.values() if m.export is not None for o in m.options)],
)
#: the selector values with an export declaration (the others are refused: nobody has taught them to the export)
KNOWN_RESIDUALS = tuple(name for name, value in RESIDUAL_SCALINGS.items() if value.export is not None)
KNOWN_NORMS = tuple(name for name in NORM_TYPES if norm_export(name) is not None)
KNOWN_LAYER_TYPES = tuple(name for name, value in LAYER_TYPES.items() if value.export is not None)


def _unknown(spec: ModelSpec) -> str | None:
    """Why a model using something no record has declared for export is refused (a method added since), or None."""
    for option, method in all_options():
        value = spec.options.get(option.name)
        declared = option.name in UNDERSTOOD and (method is None or method.export is not None)
        if not declared and value not in (None, False) and value != option.default:
            owner = method.title if method is not None else "an axis of the model"
            return f"{option.flag} ({owner}): the export does not carry this option yet"
    for name in spec.features:
        method = METHODS[name]
        if method.export is None:  # on, with every option at its default
            option, value = method.switches[0]
            given = flag(option) if value is True else f"{flag(option)} {value}"
            return f"{given} ({method.title}): the export does not carry this option yet"
    if spec.residual not in KNOWN_RESIDUALS:
        return f"--residual-scale {spec.residual}: the export has no fold for this residual yet"
    if spec.norm.type not in KNOWN_NORMS:
        return f"--norm-type {spec.norm.type}: the export does not carry this norm yet"
    if spec.layer_type not in KNOWN_LAYER_TYPES:
        return f"--decoder-layer-type {spec.layer_type}: the export does not carry this layer type yet"
    return None


def _selected(spec: ModelSpec) -> List[Tuple[Export | None, Params | None]]:
    """``(declaration, resolved options of the method that made it)`` of the spec's layer type and residual
    scaling, then of every method that is on, in method order (the norm's is
    :func:`~fairseq_deepinit.axes.norm_export`)."""
    out = []
    for value in (LAYER_TYPES[spec.layer_type], RESIDUAL_SCALINGS[spec.residual]):
        out.append((value.export, spec.features.get(declaring(value).name)))
    out += [(METHODS[name].export, p) for name, p in spec.features.items()]
    return out


def _fairseq_facts(fs: FairseqArgs, spec: ModelSpec) -> str | None:
    """fairseq's own options that neither target carries (first match wins)."""
    if fs.cross_self_attention:
        return "--cross-self-attention attends over the encoder output and the prefix in one attention"
    if spec.encoder is not None and not spec.decoder.kind.encoder_decoder:
        return "--no-cross-attention: a translation model whose decoder ignores the encoder"
    if fs.adaptive_input or fs.adaptive_softmax_cutoff or fs.character_embeddings:
        return "adaptive input/softmax or character embeddings replace the embedding table and output layer"
    if fs.encoder_layers_to_keep or fs.decoder_layers_to_keep:
        return "--*-layers-to-keep prunes layers at load time; export the pruned model from a checkpoint of it"
    return None


@dataclass(frozen=True)
class Route:
    """What :func:`classify` found (see the module docstring).

    ``placements``: per stack, ``post``, ``pre`` or ``peri``; ``norm``: ``layernorm``, ``rmsnorm``,
    ``zc-rmsnorm``, ``scalenorm`` or ``none`` (every norm of the model); ``folds``: the constants folded into
    weights, in order; ``steps``: the fold steps that carry them out
    (:data:`~fairseq_deepinit.methods.exporting.FOLD_STEPS`, in that order); ``reasons``: per target, why it is
    refused (absent: exportable); ``ct2_eps``: CTranslate2's ``layer_norm_epsilon`` (None: its defaults, 1e-5
    LayerNorm and 1e-6 RMSNorm, serve every norm).
    """

    lm: bool
    placements: Dict[str, str]
    norm: str
    norm_eps: float | None
    residual: str
    qk_norm: QKNorm | None
    activation: str
    folds: Tuple[str, ...]
    steps: Tuple[str, ...] = ()
    reasons: Dict[str, str] = field(default_factory=dict)
    ct2_eps: float | None = None
    hf_class: str | None = None

    @property
    def fairseq(self) -> str | None:
        """``stock``, ``fold`` or None (refused)."""
        if FAIRSEQ in self.reasons:
            return None
        return "fold" if self.folds else "stock"

    def check(self, target: str) -> None:
        """Raise the one-line :class:`~fairseq_deepinit.errors.ExportError` if ``target`` is refused (naming the
        other target where that one takes the model)."""
        if target in self.reasons:
            others = [t for t in TARGETS if t != target and t not in self.reasons]
            hint = f"; --to {others[0]} exports it exactly" if others else ""
            raise ExportError(f"cannot export to {target}: {self.reasons[target]}{hint}")

    def describe(self) -> str:
        """One line: the model as the export sees it, and what happens to it per target."""
        stacks = ", ".join(f"{s} {p}-norm" for s, p in self.placements.items())
        parts = [f"{'language model' if self.lm else 'translation model'}: {stacks}, norm {self.norm}"]
        if self.folds:
            parts.append("folded into the weights: " + ", ".join(self.folds))
        return "; ".join(parts)


def _ct2_eps(spec: ModelSpec, qk: QKNorm | None) -> Tuple[float | None, str | None]:
    """CTranslate2's one ``layer_norm_epsilon`` for every norm of the model, or why there is none."""
    wanted = set()  # (kind as CTranslate2 computes it, eps)
    norm = spec.norm.type
    if norm in ("layernorm", "rmsnorm"):
        wanted.add((norm, float(spec.norm.eps)))
    elif norm == "zc-rmsnorm":  # an RMSNorm of weight 1 + w (the fold step "zero-centred-gain")
        wanted.add(("rmsnorm", float(spec.norm.eps)))
    elif norm == "scalenorm":
        wanted |= {("rmsnorm", float(spec.norm.eps) ** 2 / s.dim) for s in spec.stacks}
    elif norm == "none":
        wanted.add(("rmsnorm", IDENTITY_EPS))
    if qk is not None:
        wanted.add((qk.kind, qk.eps))
    values = {eps for _kind, eps in wanted}
    if len(values) == 1:
        return values.pop(), None
    if all(eps == CT2_DEFAULT_EPS[kind] for kind, eps in wanted):
        return None, None  # LayerNorm 1e-5 with RMSNorm 1e-6: CTranslate2's own defaults
    listed = ", ".join(f"{kind} {eps:g}" for kind, eps in sorted(wanted))
    return None, (
        f"CTranslate2 gives every norm of a model one epsilon (layer_norm_epsilon, src/layers/common.cc:445-453) and "
        f"this model's norms use several ({listed})"
    )


def _ct2_facts(fs: FairseqArgs, spec: ModelSpec) -> str | None:
    """fairseq's options CTranslate2's spec has no field for."""
    act = fs.activation_fn
    if act not in CT2_ACTIVATIONS:
        return f"--activation-fn {act}: CTranslate2's fairseq activations are {', '.join(CT2_ACTIVATIONS)}"
    if fs.no_token_positional_embeddings:
        return "--no-token-positional-embeddings: CTranslate2 adds sinusoidal positions when a model has none"
    dec = int(spec.decoder.dim)
    ins = int(fs.decoder_input_dim or dec)
    outs = int(fs.decoder_output_dim or dec)
    if (ins != dec) != (outs != dec):
        return (
            "only one of --decoder-input-dim / --decoder-output-dim differs from --decoder-embed-dim; CTranslate2's "
            "project_in_out has both projections or neither"
        )
    return None


def _hf_facts(fs: FairseqArgs, spec: ModelSpec, placements: Dict[str, str]) -> Tuple[str | None, str | None]:
    """``(transformers class, None)`` of a model whose stock fairseq form one of :data:`HF_CLASSES` computes, or
    ``(None, why not)``. What only the built stock model shows is :mod:`.to_hf`'s to check."""
    lm = spec.encoder is None
    kinds = sorted(set(placements.values()))
    if len(kinds) != 1:
        mixed = ", ".join(f"{s} {p}-norm" for s, p in placements.items())
        return None, f"{mixed}: transformers' FSMT is Post-LN and M2M100 Pre-LN in both stacks"
    cls = HF_CLASSES.get((lm, kinds[0]))
    if cls is None:
        return None, (
            f"a {kinds[0]}-norm language model: transformers' XGLM (fairseq's transformer_lm) is Pre-LN"
            if lm
            else f"{kinds[0]}-norm: transformers' FSMT is Post-LN and M2M100 Pre-LN"
        )
    if fs.no_token_positional_embeddings:
        return None, "--no-token-positional-embeddings: transformers' classes always add positions"
    if fs.layernorm_embedding:
        return None, "--layernorm-embedding: transformers' FSMT, M2M100 and XGLM have no embedding norm"
    if cls != "FSMT" and (fs.decoder_learned_pos or (not lm and fs.encoder_learned_pos)):
        return None, "learned positions: transformers' M2M100 and XGLM compute sinusoidal positions only"
    if fs.decoder_input_dim not in (None, spec.decoder.dim) or fs.decoder_output_dim not in (None, spec.decoder.dim):
        return None, "--decoder-input-dim / --decoder-output-dim: transformers' classes have no projections there"
    if spec.encoder is not None and spec.encoder.dim != spec.decoder.dim:
        return None, "the encoder and decoder widths differ: transformers' classes have one d_model"
    return cls, None


def classify(args: argparse.Namespace, spec: ModelSpec | None = None) -> Route:
    """The :class:`Route` of the model of ``args`` (its resolved model arguments) and ``spec`` (its spec:
    resolved from ``args`` when not given). The plugin's part is read from the spec and the records'
    declarations only; fairseq's own options (activation, dims, adaptive softmax, ...) from
    :class:`~fairseq_deepinit.export.fairseq_args.FairseqArgs` of ``args`` (the declarations get ``args`` itself).

    Refusals are decided per target, each the first that applies: something no record has declared for
    export, then a feature neither target has (a declaration refusing both: MAtt, B2T, ResiDual, NormFormer,
    Sub-LN, Mix-LN, the reordered placement, DyT/Derf, ...; then fairseq options neither has), then what the
    target lacks, the norm's first (stock fairseq: norms other than LayerNorm with eps 1e-5, Peri-LN's output
    norms, q/k norms, FixNorm's output bias; CTranslate2: cross-attention q/k norms, several norm epsilons, an
    activation or an option its spec has no field for).
    """
    spec = spec if spec is not None else resolve(args)
    fs = FairseqArgs.of(args)
    declared = [(export, p) for export, p in _selected(spec) if export is not None]
    norm = norm_export(spec.norm.type)
    reasons = [(export.reasons(p, spec, args), export, p) for export, p in declared]
    norm_reasons = [(norm.reasons(None, spec, args), norm, None)] if norm is not None else []
    nevers = (e.never(p, spec, args) for _r, e, p in reasons + norm_reasons)
    never = _unknown(spec) or next((why for why in nevers if why), None) or _fairseq_facts(fs, spec)
    placements = {s.kind.stack: s.placement for s in spec.stacks}
    if spec.norm.type == "none":
        placements = {s: "post" for s in placements}  # without norms both placements are x + f(x)
    qk = next((e.head_norm(p, spec, args) for _r, e, p in reasons if e.head_norm is not None), None)
    everything = norm_reasons + reasons
    wanted = {step for _r, e, _p in everything for step in e.steps}
    route = dict(
        lm=spec.encoder is None,
        placements=placements,
        norm=spec.norm.type,
        norm_eps=spec.norm.eps,
        residual=spec.residual,
        qk_norm=qk,
        activation=fs.activation_fn,
        folds=tuple(line for _r, e, p in reasons if (line := e.fold_line(p, spec, args))),
        steps=tuple(step for step in FOLD_STEPS if step in wanted),
    )
    if never is not None:
        return Route(**route, reasons={t: never for t in TARGETS})
    refused = {t: next((r[t] for r, _e, _p in everything if t in r), None) for t in TARGETS}
    eps, eps_reason = _ct2_eps(spec, qk)
    refused[CTRANSLATE2] = refused[CTRANSLATE2] or eps_reason or _ct2_facts(fs, spec)
    hf_class, hf_reason = _hf_facts(fs, spec, placements)
    refused[HUGGINGFACE] = refused[HUGGINGFACE] or refused[FAIRSEQ] or hf_reason
    reasons = {t: why for t, why in refused.items() if why}
    return Route(**route, reasons=reasons, ct2_eps=eps, hf_class=None if HUGGINGFACE in reasons else hf_class)
