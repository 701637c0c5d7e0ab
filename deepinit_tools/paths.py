"""Where the tools find the plugin, the data and their default output folders.

The tools are not installed with the plugin (``pip install .`` installs ``fairseq_deepinit`` only): they
run from a checkout with its root first on the path (each entry point in ``scripts/`` and ``benchmarks/``
puts it there; the tests' root ``conftest.py`` does for the tests). The plugin they use is the one next to
them (:data:`PLUGIN_DIR`), so a tool never mixes an installed copy with a checkout's.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME = Path(__file__).resolve().parents[1]
"""The folder holding ``deepinit_tools`` and ``fairseq_deepinit``: the checkout."""

PLUGIN_DIR = HOME / "fairseq_deepinit"
USER_DIR = str(PLUGIN_DIR)
"""``fairseq-train --user-dir``: the plugin next to the tools."""

REPO = HOME
"""The checkout: default work folders (``work-data/``) and the docs the reports write into."""


def tools_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with :data:`HOME` first on ``PYTHONPATH``, so that a child
    Python (``fairseq-train`` through ``-m``, the harness's child) imports the same tools and plugin."""
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOME), full.get("PYTHONPATH", "")) if p)
    return full


def import_plugin() -> None:
    """Import (register) the plugin, and check it is the copy next to these tools."""
    import fairseq_deepinit

    found = Path(fairseq_deepinit.__file__).resolve().parent
    if found != PLUGIN_DIR:
        raise SystemExit(
            f"imported {found}, not the plugin next to these tools ({PLUGIN_DIR}); "
            f"run the tools through their scripts (scripts/, benchmarks/) or with PYTHONPATH={HOME}"
        )
