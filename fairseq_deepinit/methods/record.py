"""The record each method registers: its options, the selector values it adds, what it needs and rules out, its hooks.

A method (one paper, or one paper's released variant) is one module of :mod:`fairseq_deepinit.methods`
holding one :class:`Method`. The command-line options, the named architectures, the resolution into a
:class:`~fairseq_deepinit.spec.ModelSpec` (:mod:`fairseq_deepinit.resolve`), the model build
(:mod:`fairseq_deepinit.plan`), the resume check and docs/schemes.md's method table are all computed from
the records; nothing else lists a method, and no method names another.

A method may add values to the selectors of the model's axes: ``--init-scheme`` (:class:`InitScheme`),
``--residual-scale`` (:class:`ResidualScaling`) and ``--decoder-layer-type`` (:class:`LayerType`). It is
on when its ``enabled_by`` says so: a flag of its own (``"qk_norm"``), a selector value
(``"init_scheme=ds-init"``), or any of several (a tuple). Its options get their default when it is on;
when it is off they are refused if given, and stored as their ``off`` value. What it needs from the rest
of the model and what it rules out are :class:`Rule` declarations on the spec's axes
(``requires``, ``excludes``, ``cautions``), which one checker turns into one-line errors naming both
flags (:func:`fairseq_deepinit.checks.check_rules`); ``validate`` is left for what concerns its own options.

A method that acts while the model trains declares it with its training hooks (:class:`CheckTraining`,
:class:`ParamGroups`, :class:`AfterStep`, :class:`LossTerm`); fairseq's trainer reaches them through one loop
over the methods that are on (:func:`fairseq_deepinit.patches.build_optimizer`) and the plugin's criteria
(:class:`fairseq_deepinit.training.loss_terms.LossTermsMixin`). The hooks' code lives with its subject
(:mod:`fairseq_deepinit.training`), as the model's lives in :mod:`fairseq_deepinit.modules`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Protocol, Tuple

import torch.nn as nn
from torch import Tensor

from ..errors import DeepInitConfigError
from ..modules.norms import NORM_TYPES
from .exporting import Export

WITH_NORM = tuple(n for n in NORM_TYPES if n != "none")
SAME = object()  # Option.off: the option's default

# the spec's axes a Rule reads
PLACEMENT = "placement"  # every stack's norm placement (what --norm-placement / --*-normalize-before give)
NORM = "norm"  # --norm-type
RESIDUAL = "residual"  # --residual-scale
INIT = "init"  # --init-scheme; DEPTH_SCALED / TWO_MATRIX_FFN stand for every scheme with that property
LAYER_TYPE = "layer_type"  # --decoder-layer-type
CROSS_ATTENTION = "cross_attention"  # (True,): the decoder attends to an encoder
FLAG = "flag"  # option names (fairseq's or the plugin's): requires any of them set / excludes each one set
TAG = "tag"  # what another enabled method does (its ``tags``): excludes / cautions on it
DEPTH_SCALED = "depth-scaled"
TWO_MATRIX_FFN = "two-matrix-ffn"  # INIT's value for every scheme whose constants assume the FFN's two matrices


@dataclass(frozen=True)
class Option:
    """One command-line option: ``--<name with dashes>`` stored as ``args.<name>``.

    ``type`` is ``bool`` (a ``store_true`` flag; ``negative`` adds a ``store_false`` twin such as
    ``--no-matt-share-v``), ``int``, ``float`` or ``str``; ``default`` is its value while its method is on,
    ``off`` the value stored while it is off (a feature's option: its default unless said; a selector
    value's option: None), ``choices`` the allowed values. ``check(value)`` returns an error message for
    a bad value of the right type, or None. ``resume``: a resumed run must keep the value. ``only_with``: the
    ``enabled_by`` value the option belongs to where its method has several (``"hyper_connections=mhc"``): the
    option is refused while another of them is chosen, and the error for it given while the method is off
    names that one. Every option's argparse default is None,
    so that the resolution can tell "not given" from "given" (a negative twin's False is given).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: Tuple[Any, ...] | None = None
    metavar: str | None = None
    negative: str | None = None
    negative_help: str | None = None
    check: Callable[[Any], str | None] | None = None
    resume: bool = True
    off: Any = SAME
    only_with: str | None = None

    @property
    def flag(self) -> str:
        return flag(self.name)

    def add_to(self, group) -> None:
        """Add the option (and its negative twin) to an argparse group, unless the parser has it already
        (fairseq's ``transformer_lm`` defines NormFormer's ``--scale-*`` itself)."""
        if self.flag in group._option_string_actions:
            return
        if self.type is bool:
            group.add_argument(self.flag, action="store_true", default=None, help=self.help)
            if self.negative:
                group.add_argument(
                    self.negative, dest=self.name, action="store_false", default=None, help=self.negative_help
                )
            return
        kwargs: Dict[str, Any] = {"help": self.help}
        if self.choices is not None:
            kwargs["choices"] = self.choices
        else:
            kwargs["type"] = self.type
        if self.metavar:
            kwargs["metavar"] = self.metavar
        group.add_argument(self.flag, **kwargs)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` (resolved, not None) is not allowed, or None."""
        if self.choices is not None and value not in self.choices:
            return f"unknown {self.flag} {value!r}; choose from {', '.join(map(str, self.choices))}"
        return self.check(value) if self.check is not None else None

    def given(self, value: Any) -> str | None:
        """The flag as the user gave it (``--no-qk-norm-cross`` for a negative twin's False)."""
        return self.negative if value is False and self.negative else self.flag


@dataclass(frozen=True)
class Rule:
    """A need (``requires``), a conflict (``excludes``) or a warning (``cautions``) on one axis of the spec.

    ``values``: the axis values it allows (requires) or names (excludes, cautions); ``why`` the reason,
    in the message; ``when``: the method's own flags it applies to (NormFormer's four are one record),
    every one when empty.
    """

    axis: str
    values: Tuple[Any, ...] = ()
    why: str = ""
    when: Tuple[str, ...] = ()


def positive(name: str) -> Callable[[Any], str | None]:
    """An :class:`Option` ``check``: a finite number greater than 0 (``name``: the option's name)."""

    def check(value) -> str | None:
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            return None
        return f"{flag(name)} must be a finite number greater than 0, got {value}"

    return check


def check_cross_off(p: Any, spec: Any, option: str) -> None:
    """``--no-<option>`` (``option``: a ``*_cross`` switch, on by default) needs an encoder-decoder
    attention to leave out."""
    if not getattr(p, option) and not spec.decoder.kind.encoder_decoder:
        raise DeepInitConfigError(
            f"--no-{flag(option)[2:]}: this model has no encoder-decoder attention (a language model, or "
            "--no-cross-attention); drop it"
        )


def pre_ln(why: str = "") -> Rule:
    return Rule(PLACEMENT, ("pre",), why)


def post_ln(why: str = "") -> Rule:
    return Rule(PLACEMENT, ("post",), why)


def a_norm(why: str, norms: Tuple[str, ...] = WITH_NORM, when: Tuple[str, ...] = ()) -> Rule:
    return Rule(NORM, norms, why, when)


def plain_residual(why: str, when: Tuple[str, ...] = ()) -> Rule:
    return Rule(RESIDUAL, ("none",), why, when)


def standard_layer(why: str) -> Rule:
    return Rule(LAYER_TYPE, ("standard",), why)


def own_attention_forward(what: str) -> Tuple[Rule, ...]:
    """``excludes`` of a method that computes the attention itself (``what`` it adds): fairseq's attention
    variants the plugin's attention forward does not reproduce."""
    return (
        Rule(
            FLAG,
            ("encoder_xformers_att_config", "decoder_xformers_att_config"),
            f"fairseq's xFormers attention has no place for {what}; --attention-impl sdpa is the fused path with it",
        ),
        Rule(FLAG, ("cross_self_attention",), f"the joint source-target self-attention has no {what}"),
    )


@dataclass(frozen=True)
class InitScheme:
    """A value of ``--init-scheme``: ``apply(model, p, spec)`` re-initialises a freshly built model in place
    (``p``: the options of the method that adds it, when that method is on).

    ``default_norm`` / ``allowed_norms``: ``--norm-type auto`` and what it refuses (with ``norm_reason``);
    ``residual``: the ``--residual-scale`` it needs (``none``: any); ``requires``: its other needs (a
    Post-LN-only scheme); ``embeddings``: it re-initialises the word-embedding matrix itself;
    ``depth_scaled``: why its init depends on the depth (read by rules on ``DEPTH_SCALED``), or "";
    ``two_matrix_ffn``: why its constants assume the FFN's two matrices ``fc1``, ``fc2`` (read by rules on
    ``TWO_MATRIX_FFN``: a gated FFN's third matrix), or "".
    """

    name: str
    apply: Callable[..., None]
    doc: str
    default_norm: str = "layernorm"
    allowed_norms: Tuple[str, ...] = NORM_TYPES
    norm_reason: str = ""
    residual: str = "none"
    requires: Tuple[Rule, ...] = ()
    embeddings: bool = False
    depth_scaled: str = ""
    two_matrix_ffn: str = ""


@dataclass(frozen=True)
class ResidualScaling:
    """A value of ``--residual-scale``: ``constant(p, kind, encoder_layers, decoder_layers)`` is its constant
    for a stack of ``kind`` (DeepNorm's alpha, depth-muP's multiplier), resolved once into the spec;
    ``module(stack, sublayer, p)`` builds a sub-layer's :class:`~fairseq_deepinit.modules.residual.Residual`
    (``stack``: the :class:`~fairseq_deepinit.spec.Stack`); ``requires``: its needs (Post-LN, a norm);
    ``export``: what an exporter does with it (:class:`~.exporting.Export`; None: not taught to one yet)."""

    name: str
    module: Callable[..., nn.Module]
    doc: str
    requires: Tuple[Rule, ...] = ()
    constant: Callable[..., float] | None = None
    export: Export | None = None


@dataclass(frozen=True)
class LayerType:
    """A value of ``--decoder-layer-type``: the decoder layer class, built as ``cls(cfg, plan,
    no_encoder_attn=...)``; ``requires``: its needs (MAtt: cross-attention); ``export``: what an exporter does
    with it (:class:`~.exporting.Export`; None: not taught to one yet); ``options(p)``: the layer's typed
    options from its method's resolved options ``p`` (the plan's ``params``, so that the layer names none)."""

    name: str
    cls: type
    doc: str
    requires: Tuple[Rule, ...] = ()
    export: Export | None = None
    options: Callable[[Any], Any] | None = None


class Validate(Protocol):
    """``validate(p, spec) -> warning``: checks of the method's own options ``p`` against the resolved ``spec``
    (what the run gives included: :attr:`~fairseq_deepinit.spec.ModelSpec.task`, ``fp16``), after the rules;
    raises one line, or returns a warning to log (None: nothing to say)."""

    def __call__(self, p: Any, spec: Any) -> str | None: ...


class CheckTraining(Protocol):
    """``check_training(p, spec, cfg)``: before fairseq's trainer builds its optimizer, refuse (one line) a
    training set-up the method cannot follow; ``cfg`` is fairseq's ``Trainer.cfg`` (its sections)."""

    def __call__(self, p: Any, spec: Any, cfg: Any) -> None: ...


class ParamGroups(Protocol):
    """``param_groups(p, spec, model)``: tag every trained parameter of ``model`` with its optimizer group and
    its lr / eps / weight-decay multipliers (:func:`fairseq_deepinit.training.param_groups.tag_parameter`),
    right before fairseq hands the optimizer its flat parameter list; the groups are then checked to have
    reached the optimizer built (:func:`~fairseq_deepinit.training.param_groups.check_groups_reached`)."""

    def __call__(self, p: Any, spec: Any, model: nn.Module) -> None: ...


class StepHook(Protocol):
    """What an :class:`AfterStep` hook returns for one optimizer: ``new_update()`` runs before each of its
    ``zero_grad`` (an update starts), ``after_step()`` after each of its ``step``."""

    def new_update(self) -> None: ...

    def after_step(self) -> None: ...


class AfterStep(Protocol):
    """``after_step(p, spec, model, optimizer) -> StepHook``: called once for every optimizer fairseq's trainer
    builds (``optimizer``: fairseq's, wrapped or not by its fp16 / AMP optimizer); the hook it returns follows
    that optimizer's updates (QK-Clip's clip after each step)."""

    def __call__(self, p: Any, spec: Any, model: nn.Module, optimizer: Any) -> StepHook: ...


class LossTerm(Protocol):
    """``loss_term(p, logits, lprobs, target, padding_idx) -> (c, values)``: a term of the training loss, for
    the ``(N, V)`` output ``logits``, their float32 ``lprobs`` and the ``(N,)`` ``target``: ``values`` per
    target position (0 at padding), of which the criterion's summed loss gains ``c * sum``; logged as
    ``<method name>`` (``c * mean``) and ``<method name>_unscaled`` (``mean``) over target tokens."""

    def __call__(
        self, p: Any, logits: Tensor, lprobs: Tensor, target: Tensor, padding_idx: int
    ) -> Tuple[float, Tensor]: ...


@dataclass(frozen=True)
class Method:
    """Everything about one method (see the module docstring). Hooks get ``p``, the method's resolved
    options (:class:`~fairseq_deepinit.spec.Params`), and ``spec``, and run only while the method is on.

    - ``name``, ``title``, ``paper``, ``summary``, ``code``: ``--help``, the docs table, the model log;
    - ``enabled_by``, ``options``, the selector values it adds (``init_schemes``, ``residual_scalings``,
      ``layer_types``);
    - ``requires``, ``excludes``, ``cautions`` (:class:`Rule`); ``tags``: what it does, for another
      method's ``TAG`` rules (tag -> the flags of its own that do it, every one when empty); ``sets``:
      selector values it selects (depth-muP's residual scaling);
    - ``derive(p, layers)``: option values computed from the others (``layers``: each stack's depth, 0
      without an encoder); ``validate(p, spec)``: checks of its own options, returns a warning or None;
    - ``describe(p)``: its part of the model's log line;
    - ``layer_placements(p, layers)``: the placement of each layer of a Pre-LN stack (Mix-LN);
    - ``layer_setup(layer, p, spec)``, ``stack_setup(stack, p, spec, stack_spec)``, ``post_init(model, p,
      spec)``: modules it adds to a built layer / stack, and its step after the init scheme;
    - ``norm_args(p, position)``: keyword arguments of every norm at ``position`` (DyT/Derf's alpha);
    - ``embedding(p, dictionary, dim, path)`` / ``output_projection(p, embed_tokens)``: replacements of the
      word embedding / output layer;
    - ``validate`` (:class:`Validate`);
    - training hooks: ``check_training`` (:class:`CheckTraining`), ``param_groups`` (:class:`ParamGroups`),
      ``after_step`` (:class:`AfterStep`), ``loss_term`` (:class:`LossTerm`); ``training_task(p, spec)``: the
      fairseq ``--task`` a run of the model trains under (Admin's profiling task while omega is profiled),
      None: the user's;
    - ``families`` (``<family>_<size>`` -> axes), ``architectures`` (name -> ``(fairseq size, axes)``);
    - ``export``: what an exporter needs (:class:`~.exporting.Export`: the targets that cannot carry it and
      why, how its constants fold into stock weights); :data:`~.exporting.EXPORT_NEUTRAL` where it changes
      nothing an export carries; None (not taught to the exporters yet): a model using it is refused;
    - ``error``: the error class of its checks.
    """

    name: str
    title: str
    paper: str
    summary: str
    code: str = ""
    enabled_by: str | Tuple[str, ...] | None = None
    options: Tuple[Option, ...] = ()
    init_schemes: Tuple[InitScheme, ...] = ()
    residual_scalings: Tuple[ResidualScaling, ...] = ()
    layer_types: Tuple[LayerType, ...] = ()
    requires: Tuple[Rule, ...] = ()
    excludes: Tuple[Rule, ...] = ()
    cautions: Tuple[Rule, ...] = ()
    tags: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    sets: Mapping[str, Any] = field(default_factory=dict)
    derive: Callable[..., Dict[str, Any]] | None = None
    validate: Validate | None = None
    describe: Callable[[Any], str] | None = None
    layer_placements: Callable[..., Tuple[str, ...]] | None = None
    layer_setup: Callable[..., None] | None = None
    stack_setup: Callable[..., None] | None = None
    post_init: Callable[..., None] | None = None
    norm_args: Callable[..., Dict[str, Any]] | None = None
    embedding: Callable[..., nn.Module] | None = None
    output_projection: Callable[..., nn.Module] | None = None
    check_training: CheckTraining | None = None
    param_groups: ParamGroups | None = None
    after_step: AfterStep | None = None
    loss_term: LossTerm | None = None
    training_task: Callable[[Any, Any], str | None] | None = None
    families: Mapping[str, dict] = field(default_factory=dict)
    architectures: Mapping[str, Tuple[str, dict]] = field(default_factory=dict)
    export: Export | None = None
    error: type = DeepInitConfigError

    @property
    def switches(self) -> Tuple[Tuple[str, Any], ...]:
        """``enabled_by`` as ``(option, value)`` pairs, any of which turns the method on (value True: a flag)."""
        items = (self.enabled_by,) if isinstance(self.enabled_by, str) else self.enabled_by or ()
        return tuple((item.split("=", 1)[0], item.split("=", 1)[1]) if "=" in item else (item, True) for item in items)

    @property
    def selector_owned(self) -> bool:
        """Enabled by a selector value (``init_scheme=ds-init``): its options are None while it is off."""
        return any(value is not True for _name, value in self.switches)

    def off_value(self, option: Option) -> Any:
        """What ``option`` is stored as while the method is off."""
        if self.selector_owned:
            return None
        return option.default if option.off is SAME else option.off


def flag(name: str) -> str:
    """``ds_init_alpha`` -> ``--ds-init-alpha``."""
    return "--" + name.replace("_", "-")
