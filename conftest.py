"""Make the repository's own package importable first (tests never run a stale installed copy)."""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
