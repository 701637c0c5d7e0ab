"""``numpy.compat.long`` for fairseq 0.12 under numpy >= 2 (where ``numpy.compat`` is gone).

fairseq's ``TokenBlockDataset`` with ``break_mode="eos"`` (fairseq/data/token_block_dataset.py:125),
which ``--task language_modeling`` builds for ``fairseq-interactive`` and for ``--sample-break-mode
eos``, and ``LanguagePairDataset.num_tokens_vec`` (fairseq/data/language_pair_dataset.py:292) ask
for ``np.compat.long``, which numpy 1.x defined as Python's ``int``. :func:`install` gives numpy that
one name back when it is missing; nothing else of numpy changes.
"""

from __future__ import annotations

import types

import numpy as np


def install() -> bool:
    """Define ``numpy.compat.long = int`` if numpy lacks ``compat``; True when it was added."""
    try:
        np.compat  # noqa: B018  (numpy's module __getattr__ raises AttributeError when it is gone)
        return False
    except AttributeError:
        np.compat = types.SimpleNamespace(long=int)
        return True
