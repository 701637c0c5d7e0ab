"""The record each method registers: everything the rest of the plugin needs to know about it.

A method (one paper, or one paper's released variant) is one module of :mod:`fairseq_deepinit.methods`
holding one :class:`Method`. The command-line options (:mod:`fairseq_deepinit.options`), the named
architectures (:mod:`fairseq_deepinit.architectures`, :mod:`fairseq_deepinit.lm.architectures`), the
model build (:mod:`fairseq_deepinit.plan`), the resume check
(:mod:`fairseq_deepinit.checkpoints.config_check`) and the method table of docs/schemes.md
(:mod:`fairseq_deepinit.methods.table`) are all computed from the records; nothing else lists a method.

A method may add values to the three selectors of the model's axes: ``--init-scheme``
(:class:`InitScheme`), ``--residual-scale`` (:class:`ResidualScale`) and ``--decoder-layer-type``
(:class:`LayerType`). Its options (:class:`Option`) either belong to one selector value
(``Method.owner``: they get their default under it and are refused under any other) or are a feature
any configuration may switch on (``owner`` None: their default reproduces the model without the
feature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Mapping, Tuple

import torch.nn as nn

from ..errors import DeepInitConfigError
from ..modules.norms import NORM_TYPES
from ..modules.stacks import StackKind

WITH_NORM = tuple(n for n in NORM_TYPES if n != "none")


@dataclass(frozen=True)
class Option:
    """One command-line option: ``--<name with dashes>`` stored as ``args.<name>``.

    ``type`` is ``bool`` (a ``store_true`` flag; ``negative`` adds a ``store_false`` twin such as
    ``--no-matt-share-v``), ``int``, ``float`` or ``str``; ``default`` is the value under the option's
    owner (or always, for a feature), ``choices`` the allowed values (in the order ``--help`` and the
    error messages give them). ``check(value)`` returns an error message for a bad value of the right
    type, or None. ``resume``: a resumed run must keep the value (checked before the checkpoint loads).
    Every option's argparse default is None, so that the resolution can tell "not given" from "given".
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

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

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


@dataclass(frozen=True)
class InitScheme:
    """A value of ``--init-scheme``: ``apply(model, cfg)`` re-initialises a freshly built model in place.

    What it needs from the other axes: ``default_norm`` / ``allowed_norms`` (``--norm-type auto`` and what
    it refuses, with ``norm_reason``), ``residual`` (the ``--residual-scale`` it needs, ``none`` for any),
    ``placement`` (``"post"``: Post-LN only). ``embeddings``: it re-initialises the word-embedding matrix
    itself (refused where ``--adaptive-input`` replaces that matrix).
    """

    name: str
    apply: Callable[[nn.Module, object], None]
    doc: str
    default_norm: str = "layernorm"
    allowed_norms: Tuple[str, ...] = NORM_TYPES
    norm_reason: str = ""
    residual: str = "none"
    placement: str | None = None
    embeddings: bool = False


# build(cfg, kind of the layer, sub-layer name, layer index from 1) -> the sub-layer's residual module
ResidualBuilder = Callable[[object, StackKind, str, int], nn.Module]


@dataclass(frozen=True)
class ResidualScale:
    """A value of ``--residual-scale``: the residual module of every sub-layer; ``placement`` ``"post"``:
    defined for Post-LN only."""

    name: str
    build: ResidualBuilder
    doc: str
    placement: str | None = None


@dataclass(frozen=True)
class LayerType:
    """A value of ``--decoder-layer-type``: the decoder layer class, built as ``cls(cfg, plan,
    no_encoder_attn=...)``; ``needs_cross_attention``: refused for a decoder-only model."""

    name: str
    cls: type
    doc: str
    needs_cross_attention: bool = False


@dataclass(frozen=True)
class Method:
    """Everything about one method (see the module docstring).

    - ``name``, ``title``, ``paper``, ``code``: for ``--help``, the docs table and the model log;
    - ``summary``: one line, what it does (docs table);
    - ``owner``: ``(selector, value)`` owning :attr:`options`, or None for a feature;
    - ``init_schemes``, ``residual_scales``, ``layer_types``: selector values it adds;
    - ``validate(args)``: cross-option checks once every option is resolved (raise
      :class:`~fairseq_deepinit.errors.DeepInitConfigError`); called when the method is selected (its
      owner value), and for a feature always (it checks whether it is on);
    - ``describe(args)``: its part of the model's log line, "" when off;
    - ``layer_setup(layer, cfg)``: modules it adds to or replaces in a freshly built layer (run for every
      layer, in method order; it checks ``cfg`` for itself);
    - ``post_init(model, cfg)``: after the init scheme, in method order (it checks ``cfg`` for itself);
    - ``stack_setup(stack, cfg, kind)``: modules and constants it adds to a freshly built encoder or decoder
      (its layers built; ``kind`` the kind of its layers), in method order, when the method is selected;
    - ``placement(cfg, kind, index)``: the norm placement of a layer, where the method decides it
      (None: the stack's ``--*-normalize-before``);
    - ``norm_args(cfg, position)``: keyword arguments it gives the builder of every norm at ``position``
      (``attn``, ``ffn``, ``final``, or None for a norm without one; DyT/Derf's alpha, bias and shift);
    - ``embedding(args, dictionary, dim, path)`` / ``output_projection(cfg, embed_tokens)``: a module
      that replaces the word embedding / output layer, or None (fairseq's);
    - ``families``: named architecture families ``<family>_<size>`` -> axes (the language-model
      families are derived from them); ``architectures``: single named architectures ->
      ``(fairseq size, axes and dims)``;
    - ``error``: the error class its option checks raise.
    """

    name: str
    title: str
    paper: str
    summary: str
    code: str = ""
    owner: Tuple[str, str] | None = None
    options: Tuple[Option, ...] = ()
    init_schemes: Tuple[InitScheme, ...] = ()
    residual_scales: Tuple[ResidualScale, ...] = ()
    layer_types: Tuple[LayerType, ...] = ()
    validate: Callable[[Any], None] | None = None
    describe: Callable[[Any], str] | None = None
    layer_setup: Callable[[nn.Module, object], None] | None = None
    post_init: Callable[[nn.Module, object], None] | None = None
    stack_setup: Callable[[nn.Module, object, StackKind], None] | None = None
    placement: Callable[[object, StackKind, int], str | None] | None = None
    norm_args: Callable[[object, str | None], Dict[str, Any]] | None = None
    embedding: Callable[[object, Any, int, Any], nn.Module | None] | None = None
    output_projection: Callable[[object, nn.Module], nn.Module | None] | None = None
    families: Mapping[str, dict] = field(default_factory=dict)
    architectures: Mapping[str, Tuple[str, dict]] = field(default_factory=dict)
    error: type = DeepInitConfigError

    def selected(self, args) -> bool:
        """Whether the method takes part in the model of ``args`` (owner value chosen; features: always
        consulted, they check their own flags)."""
        return self.owner is None or getattr(args, self.owner[0], None) == self.owner[1]


def iter_layers(model: nn.Module) -> Iterator[Tuple[str, int, nn.Module]]:
    """``(stack, l, layer)`` for every layer, l counted from 1 separately per stack.

    A stack the model does not have is skipped (a decoder-only language model has no encoder).
    """
    for stack in ("encoder", "decoder"):
        module = getattr(model, stack, None)
        if module is None:
            continue
        for i, layer in enumerate(module.layers, start=1):
            yield stack, i, layer


def has_encoder(args) -> bool:
    """False for a decoder-only model: the language model stores ``encoder_layers = 0`` (lm/model.py).

    For option checks only; the formulas read each layer's kind (modules/stacks.py).
    """
    return getattr(args, "encoder_layers", None) != 0


def missing_pre_ln_flags(args) -> str:
    """For a method defined on Pre-LN: the normalize-before flags to add ("" when every stack of the model
    is Pre-LN; a decoder-only model has only the decoder's)."""
    if args.decoder_normalize_before and (args.encoder_normalize_before or not has_encoder(args)):
        return ""
    if has_encoder(args):
        return "--encoder-normalize-before --decoder-normalize-before"
    return "--decoder-normalize-before"


def flag(name: str) -> str:
    """``ds_init_alpha`` -> ``--ds-init-alpha``."""
    return "--" + name.replace("_", "-")
