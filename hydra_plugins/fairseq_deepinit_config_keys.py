"""fairseq-hydra-train: a config key that no option of its node has is one line, not Hydra's traceback.

fairseq 0.12.3's ``fairseq-hydra-train`` merges each node of the YAML (``task``, ``lr_scheduler``,
``optimizer``, ...) with the dataclass of the component it names in ``add_defaults``
(``fairseq/dataclass/initialize.py``, line 30), the first thing its job does, before ``common.user_dir``
(the plugin) is imported. A key that dataclass lacks (a typo, ``+task.nosuch=1``, or a key of the
component the YAML named before ``lr_scheduler._name=inverse_sqrt`` replaced it: ``decay_period``) ends
there in omegaconf's ``ConfigKeyError`` and Hydra's traceback, which no plugin code can see.

Hydra imports every module of the ``hydra_plugins`` namespace package when it starts (its plugin
discovery), before the job: this module, shipped with fairseq-deepinit and importing nothing of it,
replaces ``fairseq_cli.hydra_train.add_defaults`` with :func:`add_defaults`, which turns that error into
``fairseq-deepinit: error: <node>.<key> is not an option of ... ; drop it (~<node>.<key>) ...`` and exit
status 1. Any other outcome, and every other command, is unchanged; so is a run without such a key.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict

PREFIX = "fairseq-deepinit: error: "
NODES = ("task", "model", "criterion", "optimizer", "lr_scheduler", "scoring", "bpe", "tokenizer")
_ORIGINAL: Dict[str, Callable] = {}


def _node_of(cfg: Any, key: str) -> str | None:
    """The YAML node (``task``, ``lr_scheduler``, ...) that holds ``key``."""
    for node in NODES:
        value = cfg.get(node) if hasattr(cfg, "get") else None
        if hasattr(value, "keys") and key in value.keys():
            return node
    return None


def add_defaults(cfg: Any) -> None:
    """fairseq's ``add_defaults`` whose ``ConfigKeyError`` is one line and exit status 1."""
    from omegaconf.errors import ConfigKeyError

    try:
        return _ORIGINAL["add_defaults"](cfg)
    except ConfigKeyError as e:
        key = str(getattr(e, "full_key", None) or getattr(e, "key", "") or "?")
        node = _node_of(cfg, key)
        where = f"{node}.{key}" if node else key
        owner = getattr(getattr(e, "object_type", None), "__name__", None) or "its dataclass"
        name = cfg.get(node).get("_name") if node else None
        what = f"--{node.replace('_', '-')} {name} ({owner})" if node and name else owner
        print(
            f"{PREFIX}{where} is not an option of {what}: a typo, or a key of the component the YAML named before "
            f"{node or 'the node'}._name was changed. Drop it (~{where}) or check its spelling",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None


def _hydra_train_module() -> Any:
    """``fairseq_cli.hydra_train`` as the console script imports it, or as ``python -m`` runs it (``__main__``)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "fairseq_cli.hydra_train":
        return main
    return sys.modules.get("fairseq_cli.hydra_train")


def install() -> bool:
    """Replace ``fairseq_cli.hydra_train.add_defaults`` if that module is running (idempotent)."""
    module = _hydra_train_module()
    if module is None or _ORIGINAL or not hasattr(module, "add_defaults"):
        return False
    _ORIGINAL["add_defaults"] = module.add_defaults
    module.add_defaults = add_defaults
    return True


install()
