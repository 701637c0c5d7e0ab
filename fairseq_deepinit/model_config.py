"""The ``deepinit`` and ``deepinit_lm`` models' configs as fairseq dataclasses, generated from the method records,
so that both train from a YAML file with ``fairseq-hydra-train`` (docs/usage.md, ``examples/configs/``).

fairseq 0.12 has two configuration paths. ``fairseq-train`` parses flags into one flat ``argparse.Namespace``
(every component's options side by side), calls the ``--arch`` function on it and keeps it as ``cfg.model``;
``fairseq-hydra-train`` composes a YAML file into a ``DictConfig`` whose ``model`` node names the model or a
named architecture in ``_name``. For a model without a registered dataclass, as fairseq's own ``transformer``,
fairseq runs the architecture function on that node and passes it to ``build_model``
(``fairseq/models/__init__.py:89-106``). The plugin's model code, options and checks work on the Namespace;
:func:`as_namespace`, the first step of both models' ``build_model``, turns the node into the Namespace
``fairseq-train`` would have built from the same options:

- :data:`DeepInitConfig` / :data:`DeepInitLMConfig` are flat, with the argparse path's names: fairseq's own
  model options (:class:`~fairseq.models.transformer.TransformerConfig`'s fields, its ``encoder`` /
  ``decoder`` / ``quant_noise`` sub-configs prefixed as ``TransformerModel.add_args`` names them,
  ``transformer_legacy.py:87-94`` and ``dataclass/utils.py:157-166``; ``TransformerLanguageModelConfig``'s
  as they are), then every record option (:func:`fairseq_deepinit.options.option_table`), then
  ``allow_config_change``. ``TransformerConfig`` is not subclassed: its nested sub-configs hold
  ``encoder.layers`` where the architecture functions and the plugin read ``encoder_layers``.
- Every default is None, "not given", as in the argparse path (``TransformerModel.add_args`` deletes fairseq's
  defaults, every record option's is None), so that a named architecture given as ``_name``
  (``tfixup_iwslt_de_en``) fills in what the YAML leaves out, as ``--arch`` does, and the YAML's values win.
  The exceptions are fairseq's interpolations of task values (``II("task.tokens_per_sample")``; the argparse
  path reads those from the shared Namespace) and ``max_source_positions`` / ``max_target_positions``, which
  the translation tasks own in the argparse path too.
- The YAML's ``model`` node is checked against the config (unknown keys, types, a record option's choices as a
  ``ChoiceEnum``), each problem one :class:`~fairseq_deepinit.errors.DeepInitConfigError` line.
- The configs are kept here (:func:`register`), not in fairseq's ``MODEL_DATACLASS_REGISTRY``
  (``register_model(name, dataclass=...)``): ``fairseq_cli/train.py:49`` (``add_defaults``) merges every
  ``cfg.model`` whose architecture maps to a registered dataclass with it, which fails on the argparse path's
  Namespace, and ``convert_namespace_to_omegaconf`` would rebuild that Namespace from the dataclass
  (``_override_attr``, which cannot read ``TransformerConfig``'s nested fields), storing a dict instead of the
  Namespace in the checkpoints of ``fairseq-train``. fairseq's own ``transformer`` is not registered either.

A hydra run's checkpoint stores its ``model`` node as a dict of plain values (which torch's ``weights_only``
loader accepts), with the resolved options written back by :func:`keep_resolved`; loading it
(``fairseq-generate``, a resume, the resume check, Admin's export) goes through the same :func:`as_namespace`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any, Dict, Iterator, List, Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import TransformerLanguageModelConfig
from omegaconf import II, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from . import options
from .errors import DeepInitConfigError

__all__ = [
    "CONFIGS",
    "DeepInitConfig",
    "DeepInitLMConfig",
    "as_namespace",
    "config_fields",
    "keep_resolved",
    "register",
]

# translation: the tasks' values, one shared flag in the argparse path (TranslationConfig owns them)
_TASK_VALUES = {name: II(f"task.{name}") for name in ("max_source_positions", "max_target_positions")}


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _flat_fields(dc: type, prefix: str = "") -> Iterator[Tuple[str, Any, dataclasses.Field]]:
    """``(flat name, type, field)`` of a fairseq dataclass, its sub-configs' fields prefixed by their name."""
    for f in dataclasses.fields(dc):
        if f.name.startswith("_"):
            continue
        if inspect.isclass(f.type) and issubclass(f.type, FairseqDataclass):
            yield from _flat_fields(f.type, f"{prefix}{f.name}_")
        else:
            yield f"{prefix}{f.name}", f.type, f


def _optional(t: Any) -> Any:
    """``Optional[t]`` (``typing``'s: omegaconf 2.3 and fairseq's ``interpret_dc_type`` do not read ``t | None``)."""
    return t if getattr(t, "__origin__", None) is not None and type(None) in getattr(t, "__args__", ()) else Optional[t]  # noqa: UP045


def config_fields(fairseq_config: type, task_values: Dict[str, Any]) -> List[tuple]:
    """``make_dataclass`` field specs: ``fairseq_config``'s options, then the records', then ``allow_config_change``."""
    specs: Dict[str, tuple] = {}
    for name, t, f in _flat_fields(fairseq_config):
        meta = dict(f.metadata)
        if name in task_values:
            specs[name] = (name, _optional(t), dataclasses.field(default=task_values[name], metadata=meta))
        elif _is_interpolation(f.default) and not f.default.startswith("${model."):
            specs[name] = (name, t, dataclasses.field(default=f.default, metadata=meta))
        else:
            specs[name] = (name, _optional(t), dataclasses.field(default=None, metadata=meta))
    for row in options.option_table():
        if row["name"] in specs:  # fairseq's transformer_lm defines NormFormer's --scale-* itself (its flags win)
            continue
        t = ChoiceEnum([str(c) for c in row["choices"]]) if row["choices"] else row["type"]
        specs[row["name"]] = (
            row["name"],
            _optional(t),
            dataclasses.field(default=None, metadata={"help": row["help"]}),
        )
    specs["allow_config_change"] = (
        "allow_config_change",
        Optional[bool],  # noqa: UP045
        dataclasses.field(default=None, metadata={"help": "resume a checkpoint whose model options differ"}),
    )
    return list(specs.values())


def _make(name: str, fairseq_config: type, task_values: Dict[str, Any], doc: str) -> type:
    dc = dataclasses.make_dataclass(
        name,
        config_fields(fairseq_config, task_values),
        bases=(FairseqDataclass,),
        namespace={"__doc__": doc},
    )
    dc.__module__ = __name__
    return dc


DeepInitConfig = _make(
    "DeepInitConfig",
    TransformerConfig,
    _TASK_VALUES,
    "The ``deepinit`` model's options: fairseq's ``transformer`` (flat, as its flags) and every record's.",
)
DeepInitLMConfig = _make(
    "DeepInitLMConfig",
    TransformerLanguageModelConfig,
    {},
    "The ``deepinit_lm`` model's options: fairseq's ``transformer_lm`` and every record's.",
)


# model name -> its config (register)
CONFIGS: Dict[str, type] = {}


def register(model_name: str, dc: type) -> None:
    """``dc`` is ``model_name``'s config: :func:`as_namespace` checks and completes its hydra configs with it."""
    CONFIGS[model_name] = dc


def _task_name(task: Any) -> str | None:
    """``--task``: a hydra task config's ``_name``, or the ``task`` of the Namespace a task was built from."""
    cfg = getattr(task, "cfg", None)
    if OmegaConf.is_config(cfg) or isinstance(cfg, dict):
        return cfg.get("_name")
    return getattr(cfg, "_name", None) or getattr(cfg, "task", None)


def _checked(name: str, dc: type, given: Dict[str, Any]) -> None:
    """Refuse a key of the YAML's ``model`` node that is no option of the model, or a value of the wrong type.

    fairseq merges the node with the model's dataclass only when ``_name`` is the model's own name; for a named
    architecture it runs the architecture function on the bare node instead (``fairseq/models/__init__.py:89-97``),
    so the check is made here for both. Values the architecture function set are not the user's and are left
    out (fairseq's ``base_lm_architecture`` sets ``base_shuffle`` to False where its dataclass says int).
    """
    by_arch = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[name](by_arch)
    arch_values = vars(by_arch)
    fields = {f.name for f in dataclasses.fields(dc)}
    user = {k: v for k, v in given.items() if not k.startswith("_") and (k not in arch_values or arch_values[k] != v)}
    unknown = sorted(k for k in user if k not in fields)
    if unknown:
        raise DeepInitConfigError(
            f"model.{unknown[0]} is not an option of the model {name} (its options are fairseq-train's model flags "
            f"with underscores: fairseq-train --arch {name} --user-dir <plugin> --help); remove or rename it"
        )
    try:
        OmegaConf.merge(OmegaConf.structured(dc), user)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise DeepInitConfigError(f"model.{key}: {str(e).splitlines()[0]}") from None


def as_namespace(cfg: Any, task: Any = None) -> argparse.Namespace:
    """The Namespace ``fairseq-train`` builds the model from, for a model config of either path.

    A Namespace (the argparse path) is returned as it is. A hydra ``model`` node (a ``DictConfig``; checked by
    :func:`_checked`, completed by the dataclass's defaults, whose interpolations of task values are resolved
    against the node's root as fairseq's ``merge_with_parent`` does; or the complete dict a hydra checkpoint
    stores) gives its values other than None (choices as strings), ``arch`` and ``_name`` its ``_name``,
    ``task`` the task's name where ``task`` is given, then the architecture function of ``_name`` (fairseq's
    ``build_model`` already ran it for a named architecture; it only sets what is absent, so once more changes
    nothing).
    """
    if isinstance(cfg, argparse.Namespace):
        return cfg
    name = cfg.get("_name")
    if OmegaConf.is_config(cfg):
        given = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        dc = CONFIGS[ARCH_MODEL_NAME_REGISTRY[name]]
        _checked(name, dc, given)
        defaults = OmegaConf.structured(dc)
        defaults.__dict__["_parent"] = cfg.__dict__["_parent"]  # II("task....") resolves against the root
        values = {**OmegaConf.to_container(defaults, resolve=True, enum_to_str=True), **given}
    else:
        values = dict(cfg)
    # None is "not given": absent, as fairseq's model options are from a Namespace unless given
    # (argparse.SUPPRESS, fairseq/options.py:141-146), so that the architecture functions' getattr defaults apply
    args = argparse.Namespace(**{k: v for k, v in values.items() if v is not None})
    args.arch = name
    if task is not None:
        args.task = _task_name(task)
    ARCH_CONFIG_REGISTRY[name](args)
    return args


def keep_resolved(cfg: Any, args: argparse.Namespace) -> None:
    """Write the resolved options of ``args`` back into ``cfg``, the hydra ``model`` node it came from.

    fairseq-train resolves its Namespace in place, so its checkpoints store the resolved options (the
    module docstring of :mod:`fairseq_deepinit.options`); fairseq passes the YAML's node itself to
    ``build_model`` (the trainer's ``cfg.model``), so this makes a hydra checkpoint store them too. Only the
    config's fields are written (a field the build left unset stays as it is); a Namespace is left alone.
    """
    if not OmegaConf.is_config(cfg):
        return
    fields = {f.name for f in dataclasses.fields(CONFIGS[ARCH_MODEL_NAME_REGISTRY[cfg.get("_name")]])}
    with open_dict(cfg):
        for name, value in vars(args).items():
            if name in fields and not name.startswith("_"):
                cfg[name] = value
