"""The ``deepinit`` and ``deepinit_lm`` models' fairseq dataclass configs, generated from the method records, so
that both train from a YAML file with ``fairseq-hydra-train`` (docs/usage.md, ``examples/configs/``).

fairseq 0.12 has two configuration paths. ``fairseq-train`` parses flags into one flat
``argparse.Namespace`` (every component's options side by side), calls the ``--arch`` function on it and keeps
it as ``cfg.model``; ``fairseq-hydra-train`` composes a YAML file into a ``DictConfig`` and merges its
``model`` node with the dataclass registered for the model's name (``fairseq/models/__init__.py:82-89``). The
plugin's model code, options and checks work on the first; this module makes the second end in it:

- :data:`DeepInitConfig` / :data:`DeepInitLMConfig` are flat, with the argparse path's names: fairseq's own
  model options (:class:`~fairseq.models.transformer.TransformerConfig`'s fields, its ``encoder`` /
  ``decoder`` / ``quant_noise`` sub-configs prefixed as ``TransformerModel.add_args`` names them,
  ``transformer_legacy.py:87-94`` and ``dataclass/utils.py:157-166``; ``TransformerLanguageModelConfig``'s
  as they are), then every record option (:func:`fairseq_deepinit.options.option_table`), then
  ``allow_config_change``. ``TransformerConfig`` itself is not subclassed: its nested sub-configs hold
  ``encoder.layers`` where the architecture functions and the plugin read ``encoder_layers``, and fairseq's
  own ``transformer`` is not registered with it either (it takes the legacy path).
- Every default is None, as in the argparse path (``TransformerModel.add_args`` deletes fairseq's defaults,
  every record option's is None), so that a named architecture given as ``_name`` (``tfixup_iwslt_de_en``)
  fills in what the YAML leaves out, as ``--arch`` does, and the YAML's values win. The exceptions are
  fairseq's interpolations of task values (``II("task.tokens_per_sample")``; the argparse path reads those
  from the shared Namespace) and ``max_source_positions`` / ``max_target_positions``, which the translation
  tasks own in the argparse path too.
- A record option with choices is a ``ChoiceEnum``: a value outside them is refused when the YAML is merged.
- :func:`as_namespace` turns the merged ``model`` node into the Namespace ``fairseq-train`` would have built
  (the values, ``arch`` and ``task``, then the architecture function); ``build_model`` of both models starts
  with it, and the resume check reads a hydra checkpoint's ``cfg.model`` with it.
- :func:`register` registers a config where fairseq looks it up (its ``MODEL_DATACLASS_REGISTRY`` and hydra's
  ``model`` group), as ``register_model(name, dataclass=...)`` does (``fairseq/models/__init__.py:143-154``),
  without that decorator's two other effects, which would change the argparse path: ``cls.__dataclass``
  makes ``convert_namespace_to_omegaconf`` rebuild ``cfg.model`` from the dataclass (``_override_attr``),
  dropping every value it has no field for and storing a dict instead of the Namespace in checkpoints, and
  the no-op architecture it registers under the model's name would replace ``deepinit`` / ``deepinit_lm``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any, Dict, Iterator, List, Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import ARCH_CONFIG_REGISTRY, MODEL_DATACLASS_REGISTRY
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import TransformerLanguageModelConfig
from hydra.core.config_store import ConfigStore
from omegaconf import II, OmegaConf

from . import options

__all__ = ["DeepInitConfig", "DeepInitLMConfig", "as_namespace", "config_fields", "register"]

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
        bool,
        dataclasses.field(default=False, metadata={"help": "resume a checkpoint whose model options differ"}),
    )
    return list(specs.values())


def _from_namespace(cls, args):
    """fairseq's ``build_model`` passes the argparse path's Namespace here when ``--arch`` is the model's own
    name (``fairseq/models/__init__.py:87-88``): it stays the Namespace, resolved in place and stored in the
    checkpoint, as under every other ``--arch``."""
    return args if isinstance(args, argparse.Namespace) else FairseqDataclass.from_namespace.__func__(cls, args)


def _make(name: str, fairseq_config: type, task_values: Dict[str, Any], doc: str) -> type:
    dc = dataclasses.make_dataclass(
        name,
        config_fields(fairseq_config, task_values),
        bases=(FairseqDataclass,),
        namespace={"from_namespace": classmethod(_from_namespace), "__doc__": doc},
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


def register(model_name: str, dc: type) -> None:
    """Register ``dc`` as ``model_name``'s config for fairseq's hydra path (see the module docstring)."""
    MODEL_DATACLASS_REGISTRY[model_name] = dc
    node = dc()
    node._name = model_name
    ConfigStore.instance().store(name=model_name, group="model", node=node, provider="fairseq")


def _task_name(task: Any) -> str | None:
    cfg = getattr(task, "cfg", None)
    name = cfg.get("_name") if OmegaConf.is_config(cfg) or isinstance(cfg, dict) else getattr(cfg, "_name", None)
    return name if name is not None else getattr(getattr(task, "args", None), "task", None)


def as_namespace(cfg: Any, task: Any = None) -> argparse.Namespace:
    """The Namespace ``fairseq-train`` builds the model from, for a model config of either path.

    A Namespace (the argparse path) is returned as it is. A hydra ``model`` node (a ``DictConfig``, or the dict
    a hydra checkpoint stores) gives its values other than None (interpolations resolved, choices as strings),
    ``arch`` and ``_name`` its ``_name``, ``task`` the task's name where ``task`` is given, then the architecture
    function of ``_name`` (fairseq's ``build_model`` already ran it for a named architecture; it only sets
    what is None, so once more changes nothing).
    """
    if isinstance(cfg, argparse.Namespace):
        return cfg
    values = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else dict(cfg)
    # None is "not given": absent, as fairseq's model options are from a Namespace unless given
    # (argparse.SUPPRESS, fairseq/options.py:141-146), so that the architecture functions' getattr defaults apply
    args = argparse.Namespace(**{k: v for k, v in values.items() if v is not None})
    args.arch = values.get("_name")
    if task is not None:
        args.task = _task_name(task)
    arch_fn = ARCH_CONFIG_REGISTRY.get(args.arch)
    if arch_fn is not None:
        arch_fn(args)
    return args
