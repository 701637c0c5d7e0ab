"""The one checker of the records' declarations: every ``requires`` / ``excludes`` / ``cautions``
:class:`~fairseq_deepinit.methods.record.Rule` of the selected axis values and of every method that is on,
against a resolved :class:`~fairseq_deepinit.spec.ModelSpec`.

A broken rule is one line naming the flag that declared it and the flag that set the value it refuses
(``--norm-type none``, or the ``--init-scheme t-fixup`` that resolved it; ``--norm-placement peri``, or the
``--*-normalize-before`` flags to add), and what to do. Two declarations that need disjoint values of one
axis (a Pre-LN method with a Post-LN-only residual) are refused first, naming both. A caution is returned
as a warning; then each method's own ``validate`` runs.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .methods import INIT_SCHEMES, LAYER_TYPES, RESIDUAL_SCALINGS, declaring
from .methods.record import (
    CROSS_ATTENTION,
    DEPTH_SCALED,
    FLAG,
    INIT,
    LAYER_TYPE,
    NORM,
    PLACEMENT,
    RESIDUAL,
    TAG,
    TWO_MATRIX_FFN,
    WITH_NORM,
    Method,
    Rule,
    flag,
)
from .spec import ModelSpec

PACKAGE = __name__.rpartition(".")[0]
PLACED = {"pre": "is defined on Pre-LN", "post": "is defined for Post-LN only"}
Declared = Tuple[str, Method, Rule]  # (who declared it, the method it comes from, the rule)


def who(method: Method, v: Dict[str, Any], when: Tuple[str, ...] = ()) -> str:
    """The method's flags as given: those of ``when`` that are set, else its switches that are on."""
    if when:
        return " ".join(flag(name) for name in when if v.get(name))
    on = [(name, value) for name, value in method.switches if (v.get(name) if value is True else v.get(name) == value)]
    return " ".join(flag(name) if value is True else f"{flag(name)} {value}" for name, value in on)


def _why(rule: Rule, who_: str) -> str:
    """The rule's reason, its verbs agreeing with ``who_`` (``add{s}``, ``appl{ies}``)."""
    plural = who_.count("--") > 1
    return rule.why.format(s="" if plural else "s", ies="y" if plural else "ies")


class _Check:
    """One spec's rules: the spec, fairseq's arguments, the methods that are on."""

    def __init__(self, spec: ModelSpec, args: Any, on: List[Method]) -> None:
        self.spec, self.args, self.on, self.v = spec, args, on, spec.options

    def given(self, name: str) -> bool:
        return getattr(self.args, name, None) not in (None, "auto")

    def source(self, axis: str) -> str:
        """The flag that set the value of ``axis``."""
        v = self.v
        if axis == NORM:
            return f"--norm-type {v['norm_type']}" if self.given("norm_type") else f"--init-scheme {v['init_scheme']}"
        if axis == RESIDUAL:
            return f"--residual-scale {v['residual_scale']}" if self.given("residual_scale") else self.source(INIT)
        return (
            f"--decoder-layer-type {v['decoder_layer_type']}"
            if axis == LAYER_TYPE
            else f"--init-scheme {v['init_scheme']}"
        )

    def actual(self, axis: str) -> Tuple[Any, ...]:
        spec = self.spec
        if axis == PLACEMENT:
            return tuple(s.placement for s in spec.stacks)
        if axis == CROSS_ATTENTION:
            return (spec.decoder.kind.encoder_decoder,)
        if axis == RESIDUAL and any(spec.residual in m.sets.values() for m in self.on):
            return ("none",)  # a scaling that a method selects (depth-muP's) answers for itself, in its excludes
        return ({NORM: spec.norm.type, RESIDUAL: spec.residual, INIT: spec.init, LAYER_TYPE: spec.layer_type}[axis],)

    def missing(self, who_: str, rule: Rule, method: Method) -> str | None:
        """The message of a ``requires`` rule the spec does not meet, or None."""
        why = _why(rule, who_)
        if rule.axis == FLAG:
            if any(getattr(self.args, name, None) for name in rule.values):
                return None
            return f"{who_} {why}; add {flag(rule.values[0])}" + "".join(f" (or {flag(n)})" for n in rule.values[1:])
        wrong = [a for a in self.actual(rule.axis) if a not in rule.values]
        if not wrong:
            return None
        placement, be = self.v["norm_placement"], "are" if who_.count("--") > 1 else "is"
        if rule.axis == PLACEMENT and rule.values == ("post",):
            remove = "--encoder-normalize-before / --decoder-normalize-before"
            if placement != "auto":
                remove = f"--norm-placement {placement} (or give --norm-placement post)"
            return f"{who_} is defined for Post-LN only; remove {remove}"
        if rule.axis == PLACEMENT:
            head = f"{who_} {be} defined on Pre-LN" + (f" ({why})" if why else "")
            if placement != "auto":
                return f"{head}, and --norm-placement {placement} is another; use --norm-placement pre or drop {who_}"
            add = (
                "--encoder-normalize-before --decoder-normalize-before"
                if self.spec.encoder
                else "--decoder-normalize-before"
            )
            families = " / ".join(f"{f}_*" for f in method.families)
            return f"{head}; add {add}" + (f" (the {families} architectures set them)" if families else "")
        if rule.axis == NORM and wrong[0] == "none":
            return f"{who_} {why}, and {self.source(NORM)} removes the norms; drop one of them"
        if rule.axis == NORM:
            norms = ", ".join(rule.values) if rule.values != WITH_NORM else "a norm"
            return (
                f"{who_} {why} ({norms}), not --norm-type {wrong[0]}; use --norm-type {rule.values[0]} or drop {who_}"
            )
        if rule.axis in (RESIDUAL, LAYER_TYPE):
            return f"{who_} {why}; drop {self.source(rule.axis)}"
        if self.spec.encoder is None:  # CROSS_ATTENTION
            return f"{who_} {why}, which a decoder-only language model does not have; drop {who_}"
        return f"{who_} {why}; drop --no-cross-attention or {who_}"

    def matches(self, rule: Rule, own: Method) -> List[Tuple[str, str]]:
        """``(what, why)`` for each value of the spec that an ``excludes`` / ``cautions`` rule names."""
        if rule.axis == FLAG:
            return [(flag(n), rule.why) for n in rule.values if getattr(self.args, n, None)]
        if rule.axis == TAG:
            return [
                (who(m, self.v, when), rule.why)
                for m in self.on
                if m is not own
                for tag, when in m.tags.items()
                if tag in rule.values and (not when or any(self.v.get(n) for n in when))
            ]
        if rule.axis == INIT:
            scheme = INIT_SCHEMES[self.spec.init]
            depth = scheme.depth_scaled if DEPTH_SCALED in rule.values else ""
            ffn = scheme.two_matrix_ffn if TWO_MATRIX_FFN in rule.values else ""
            named = self.spec.init in rule.values or depth or ffn
            return [(self.source(INIT), "; ".join(r for r in (depth, ffn, rule.why) if r))] if named else []
        return [(self.source(rule.axis), rule.why)] if self.actual(rule.axis)[0] in rule.values else []


def _declared(spec: ModelSpec, on: List[Method]) -> List[Declared]:
    """The ``requires`` of the selected axis values, then of the methods that are on (a rule with ``when``
    only while one of those flags is set)."""
    out = []
    for selector, value in (
        ("init_scheme", INIT_SCHEMES[spec.init]),
        ("residual_scale", RESIDUAL_SCALINGS[spec.residual]),
        ("decoder_layer_type", LAYER_TYPES[spec.layer_type]),
    ):
        out += [(f"{flag(selector)} {value.name}", declaring(value), rule) for rule in value.requires]
    for method in on:
        out += [
            (who(method, spec.options, rule.when), method, rule)
            for rule in method.requires
            if not rule.when or any(spec.options.get(n) for n in rule.when)
        ]
    return out


def _conflicts(declared: List[Declared]) -> None:
    """Two declarations needing disjoint values of one axis: refused, naming both."""
    for i, (a, method, ra) in enumerate(declared):
        for b, _m, rb in declared[i + 1 :]:
            if ra.axis == rb.axis and ra.axis not in (FLAG, TAG) and not set(ra.values) & set(rb.values):
                needs = [
                    PLACED.get(r.values[0], f"needs {flag(r.axis)} {'/'.join(map(str, r.values))}") for r in (ra, rb)
                ]
                raise method.error(f"{a} {needs[0]} and {b} {needs[1]}; drop one of them")


def check_rules(spec: ModelSpec, args: Any, on: List[Method]) -> List[Tuple[str, str]]:
    """Raise the first broken rule (see the module docstring); return the cautions as ``(logger, warning)``."""
    check, notes, declared = _Check(spec, args, on), [], _declared(spec, on)
    _conflicts(declared)
    for who_, method, rule in declared:  # the selected values of methods that are off (T-Fixup's, ...) first
        message = None if method in on else check.missing(who_, rule, method)
        if message:
            raise method.error(message)
    for method in on:
        for who_, _m, rule in (d for d in declared if d[1] is method):
            message = check.missing(who_, rule, method)
            if message:
                raise method.error(message)
        for rule in method.excludes:
            for what, why in check.matches(rule, method):
                name = who(method, spec.options, rule.when)
                fix = f"use another --init-scheme or drop {name}" if rule.axis == INIT else "drop one of them"
                raise method.error(f"{name} does not combine with {what} ({why}); {fix}")
        logger = f"{PACKAGE}.methods.{method.name}"
        name = who(method, spec.options)
        notes += [
            (logger, f"{name} with {what}: {why}")
            for rule in method.cautions
            for what, why in check.matches(rule, method)
        ]
        warning = method.validate(spec.features[method.name], spec) if method.validate else None
        notes += [(logger, warning)] if warning else []
    return notes
