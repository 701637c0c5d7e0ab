"""``resolve(args) -> ModelSpec``: the options of a ``deepinit`` model resolved, once, into its spec.

:func:`resolve` reads the options (fairseq's Namespace or ``TransformerConfig``, a checkpoint's stored
arguments) and changes nothing in them. In order:

1. the axes: ``--norm-placement`` against fairseq's ``--*-normalize-before``, the init scheme, the norm
   type and eps (``auto`` from the scheme), the residual scaling (``auto`` from the scheme), the decoder
   layer type, the attention implementation;
2. every method's options: their defaults while the method is on (each value checked), their ``off``
   value while it is off, where a given one is an error; then what the methods derive (``derive``) and
   the selector values they set (``sets``);
3. the stacks: each one's placement, each layer's (a method's per-layer rule), the residual scaling's
   constant;
4. the rules of the selected values and of the methods that are on
   (:func:`fairseq_deepinit.checks.check_rules`), each method's own ``validate``.

:func:`store` is the fairseq boundary: it writes the resolved values, and fairseq's normalize-before
booleans derived from the spec's stacks, into the Namespace that fairseq builds from and checkpoints.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .axes import AXES
from .checks import check_rules, who
from .errors import DeepInitConfigError
from .methods import INIT_SCHEMES, METHODS, RESIDUAL_SCALINGS, declaring
from .methods.record import Method, Option, flag
from .modules.norms import POINTWISE_NORMS
from .modules.stacks import DECODER, DECODER_ONLY, ENCODER
from .spec import ModelSpec, Norm, Params, Stack

OPTIONS_LOGGER = "fairseq_deepinit.options"
Notes = List[Tuple[str, str]]


def _get(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def _is_on(method: Method, v: Dict[str, Any]) -> bool:
    return any(bool(v.get(name)) if value is True else v.get(name) == value for name, value in method.switches)


def _method_options(args: Any, v: Dict[str, Any], methods: List[Method]) -> None:
    """Step 2's first half for ``methods`` (see the module docstring)."""
    for method in methods:
        enablers = dict(method.switches)
        for option in (o for o in method.options if o.name in enablers):  # a feature's own flag
            v[option.name] = option.default if _get(args, option.name) is None else _get(args, option.name)
        options = [o for o in method.options if o.name not in enablers]
        if _is_on(method, v):
            for option in options:
                value = v[option.name] = option.default if _get(args, option.name) is None else _get(args, option.name)
                problem = None if value is None else option.problem(value)
                if problem:
                    raise method.error(problem)
            _only_with(args, v, method, options)
            continue
        given, owners = [], []
        for option in options:
            value = _get(args, option.name)
            # a selector value's options are stored as None while it is off; a store_true flag's False is "not
            # given" (an older stored form), a negative twin's False is what --no-<flag> gave
            unset = (None,) if option.negative else (None, False)
            if value not in (unset if method.selector_owned else (None, method.off_value(option))):
                given.append(option.given(value))
                owners.append(option.only_with)
            v[option.name] = method.off_value(option)
        if given and method.selector_owned:
            name, value = owners[0].split("=", 1) if owners[0] else method.switches[0]
            use, chosen = f"{flag(name)} {value}", v[name]
            raise DeepInitConfigError(f"{given[0]} only applies to {use}, not {chosen}; drop it or use {use}")
        if given:
            enabler, one = " or ".join(flag(name) for name in enablers), len(given) == 1
            raise method.error(f"{' '.join(given)} need{'s' * one} {enabler}; add it or drop {'it' if one else 'them'}")


def _only_with(args: Any, v: Dict[str, Any], method: Method, options: List[Option]) -> None:
    """An option given for another ``enabled_by`` value of its method than the one chosen (mHC's options under
    ``--hyper-connections hc``) is refused, naming the value it belongs to."""
    for option in options:
        if option.only_with is None or _get(args, option.name) is None:
            continue
        name, value = option.only_with.split("=", 1)
        if v[name] != value:
            use = f"{flag(name)} {value}"
            raise method.error(f"{option.flag} only applies to {use}, not {v[name]}; drop it or use {use}")


def _own_switch(method: Method) -> bool:
    """A method switched on by values of an option of its own (``--hyper-connections hc``), not of an axis."""
    return all(name in {o.name for o in method.options} for name, _value in method.switches)


def _owned_by(selector: str) -> List[Method]:
    return [m for m in METHODS.values() if m.switches and all(name == selector for name, _v in m.switches)]


def _problem(v: Dict[str, Any], name: str) -> None:
    problem = AXES[name].problem(v[name])
    if problem:
        raise DeepInitConfigError(problem)


def _axes(args: Any, v: Dict[str, Any], notes: Notes) -> Dict[str, bool]:
    """Step 1, with the options of the selectors' values; returns fairseq's two flags as the placement has them."""
    for option in AXES.values():
        v[option.name] = option.default if _get(args, option.name) is None else _get(args, option.name)
    before = {s: bool(_get(args, f"{s}_normalize_before")) for s in ("encoder", "decoder")}
    placement = v["norm_placement"] = _get(args, "norm_placement") or "auto"
    problem = METHODS["placement"].options[0].problem(placement)
    if problem:
        raise DeepInitConfigError(problem)
    if placement == "post" and any(before.values()):
        raise DeepInitConfigError(
            "--norm-placement post contradicts --encoder-/--decoder-normalize-before (given, or set by the "
            "--arch); drop one of them"
        )
    if placement not in ("auto", "post"):
        before = {"encoder": True, "decoder": True}
    _problem(v, "init_scheme")
    _method_options(args, v, _owned_by("init_scheme"))
    _problem(v, "norm_eps")
    _problem(v, "norm_type")
    scheme = INIT_SCHEMES[v["init_scheme"]]
    if v["norm_type"] == "auto":
        v["norm_type"] = scheme.default_norm
    elif v["norm_type"] not in scheme.allowed_norms and not v["force_norm_with_scheme"]:
        raise DeepInitConfigError(
            f"--init-scheme {scheme.name} needs --norm-type {' or '.join(scheme.allowed_norms)} "
            f"({scheme.norm_reason}); got --norm-type {v['norm_type']}. Drop --norm-type, or add "
            "--force-norm-with-scheme for an ablation."
        )
    if v["norm_type"] in POINTWISE_NORMS:
        # nothing is divided: an eps would be stored and never used (stored as None, so that stored args resolve again)
        if _get(args, "norm_eps") is not None:
            raise DeepInitConfigError(
                f"--norm-eps does not apply to --norm-type {v['norm_type']} (a point-wise function, no statistics, "
                "nothing divided by); drop --norm-eps"
            )
        v["norm_eps"] = None
    _method_options(args, v, _owned_by("norm_type"))
    if v["residual_scale"] == "auto":
        v["residual_scale"] = scheme.residual
    elif scheme.residual != "none" and v["residual_scale"] != scheme.residual:
        raise DeepInitConfigError(
            f"--init-scheme {scheme.name} needs --residual-scale {scheme.residual}; got {v['residual_scale']}. "
            f"Drop --residual-scale or set it to {scheme.residual}."
        )
    _problem(v, "residual_scale")
    _problem(v, "decoder_layer_type")
    if v["norm_type"] == "none" and any(before.values()):
        # without a norm, Pre-LN and Post-LN compute the same x + f(x): the flag is harmless but does nothing
        notes.append((OPTIONS_LOGGER, "--encoder/--decoder-normalize-before have no effect with --norm-type none "
                      "(no norm to place); the model is the same as without them"))  # fmt: skip
    _method_options(args, v, _owned_by("decoder_layer_type") + _owned_by("residual_scale"))
    _problem(v, "attention_impl")
    if v["attention_impl"] == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        raise DeepInitConfigError(
            f"--attention-impl sdpa needs torch >= 2.0 (found {torch.__version__}); use --attention-impl fairseq"
        )
    for name in ("encoder_xformers_att_config", "decoder_xformers_att_config"):
        if v["attention_impl"] == "sdpa" and _get(args, name):
            raise DeepInitConfigError(
                f"{flag(name)} selects xFormers attention and --attention-impl sdpa selects PyTorch's fused kernel; "
                "use one of them"
            )
    return before


def _derive(v: Dict[str, Any], on: List[Method], layers: Dict[str, int], args: Any) -> None:
    """Step 2's second half: the values a method derives, the selector values it sets."""
    setters: Dict[str, Method] = {}
    for method in on:
        if method.derive is not None:
            v.update(method.derive(_params(method, v), layers))
        for selector, value in method.sets.items():
            if v[selector] not in ("none", value):  # "none": nobody asked for a residual scaling
                source = f"{flag(selector)} {v[selector]}"
                if selector in setters:
                    source += f" (set by {who(setters[selector], v)})"
                elif _get(args, selector) in (None, "auto"):
                    source += f" (needed by --init-scheme {v['init_scheme']})"
                raise method.error(f"{who(method, v)} sets {flag(selector)} {value} and {source} is another; drop one")
            v[selector], setters[selector] = value, method
    for method in (m for m in METHODS.values() if m not in on):
        for selector, value in method.sets.items():
            if v[selector] == value:
                enabler = " or ".join(flag(n) if on_ is True else f"{flag(n)} {on_}" for n, on_ in method.switches)
                raise method.error(f"{flag(selector)} {value} is set by {enabler}; use {enabler.split(' or ')[0]} "
                                   "instead")  # fmt: skip


def _params(method: Method, v: Dict[str, Any]) -> Params:
    return Params({o.name: v[o.name] for o in method.options})


def _stacks(args: Any, v: Dict[str, Any], before: Dict[str, bool], features: Dict[str, Params]):
    """Step 3: the encoder (None for a decoder-only model) and the decoder."""
    names = ("encoder", "decoder") if _get(args, "encoder_layers") else ("decoder",)  # a language model stores 0
    cross = "encoder" in names and not _get(args, "no_cross_attention")
    kinds = {"encoder": ENCODER, "decoder": DECODER if cross else DECODER_ONLY}
    layers = {"encoder": 0}
    for s in names:
        keep = _get(args, f"{s}_layers_to_keep")  # fairseq's build_model counts them as the layers
        layers[s] = len(keep.split(",")) if keep else _get(args, f"{s}_layers")
    residual = RESIDUAL_SCALINGS[v["residual_scale"]]
    p = features.get(declaring(residual).name)
    placers = [(m, features[m.name]) for m in METHODS.values() if m.layer_placements and m.name in features]
    out = {}
    for s in names:
        placement = v["norm_placement"] if v["norm_placement"] != "auto" else ("pre" if before[s] else "post")
        placements = (placement,) * layers[s]
        for method, q in placers:
            placements = method.layer_placements(q, layers[s])
        constant = residual.constant(p, kinds[s], layers["encoder"], layers["decoder"]) if residual.constant else None
        out[s] = Stack(kinds[s], layers[s], _get(args, f"{s}_embed_dim"), placement, placements, constant)
    return out.get("encoder"), out["decoder"]


def resolve(args: Any) -> ModelSpec:
    """The spec of the model ``args`` describes (see the module docstring); ``args`` is only read.

    Raises :class:`~fairseq_deepinit.errors.DeepInitConfigError` (or a method's subclass) with one line
    for every combination that cannot be built.
    """
    v: Dict[str, Any] = {}
    notes: Notes = []
    before = _axes(args, v, notes)
    _method_options(args, v, [m for m in METHODS.values() if m.switches and (not m.selector_owned or _own_switch(m))])
    on = [m for m in METHODS.values() if m.switches and _is_on(m, v)]
    _derive(v, on, {"encoder": _get(args, "encoder_layers") or 0, "decoder": _get(args, "decoder_layers")}, args)
    features = {m.name: _params(m, v) for m in on}
    encoder, decoder = _stacks(args, v, before, features)
    spec = ModelSpec(
        init=v["init_scheme"],
        norm=Norm(v["norm_type"], v["norm_eps"], bool(_get(args, "export"))),
        residual=v["residual_scale"],
        layer_type=v["decoder_layer_type"],
        attention=v["attention_impl"],
        encoder=encoder,
        decoder=decoder,
        features=Params(features),
        options=Params({**v, **{f"{s}_normalize_before": b for s, b in before.items()}}),
        task=_get(args, "task"),
        fp16=bool(_get(args, "fp16") or _get(args, "memory_efficient_fp16")),
    )
    notes += check_rules(spec, args, on)
    if _get(args, "layernorm_embedding") and spec.norm.type == "none":
        raise DeepInitConfigError(
            "--layernorm-embedding asks for an embedding norm but --norm-type is none; drop one of them"
        )
    return ModelSpec(**{**spec.__dict__, "notes": tuple(notes)})


def fairseq_flags(spec: ModelSpec) -> Dict[str, bool]:
    """fairseq's ``--encoder-/--decoder-normalize-before`` of the spec's stacks (:attr:`Stack.final_norm`): what
    fairseq builds its final norms from, and what a stock model exported from the spec needs."""
    return {f"{stack.kind.stack}_normalize_before": stack.final_norm for stack in spec.stacks}


def store(spec: ModelSpec, args: argparse.Namespace) -> None:
    """Write the spec's resolved options into ``args`` (what fairseq builds the model from and saves in its
    checkpoints), fairseq's ``--encoder-/--decoder-normalize-before`` derived from the stacks' placements."""
    for name, value in {**spec.options, **fairseq_flags(spec)}.items():
        setattr(args, name, value)
    args.share_decoder_input_output_embed = bool(getattr(args, "share_decoder_input_output_embed", False))


def log_notes(spec: ModelSpec) -> None:
    """The resolution's warnings, each under the logger of the module that declared it."""
    for name, message in spec.notes:
        logging.getLogger(name).warning(message)


def describe(spec: ModelSpec) -> str:
    """The model's log line: the resolved axes, then each method's own part."""
    parts = [
        f"init={spec.init}",
        f"norm={spec.norm.type}",
        *(f"{s.kind.stack}={s.placement}-norm" for s in spec.stacks),
    ]
    parts += [f"residual={spec.residual}", f"decoder-layer={spec.layer_type}"]
    parts += [METHODS[name].describe(p) for name, p in spec.features.items() if METHODS[name].describe]
    return "deepinit: " + ", ".join(part for part in parts if part)
