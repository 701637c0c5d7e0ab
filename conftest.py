"""Make the repository's own packages importable first (tests never run a stale installed copy): the
plugin and the tools (``deepinit_tools``) in this process, and in every child process a test starts
(``PYTHONPATH``), so that ``python scripts/<x>.py`` and ``python benchmarks/<x>.py`` import this
checkout's tools and plugin. The one place tests touch the import path."""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if _paths[0] != ROOT:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, *_paths] if p)
