"""The stall threshold of ``deepinit-compare``: the validation targets' cross-entropy under the training
set's unigram distribution, read from the data-bin itself (the Multi30k matrix computes the same from its
raw text, ``deepinit_tools.matrix.cells.unigram_bits``)::

    H = -(1/T) sum_t log2(c(w_t) / sum_w c(w))

over the T validation target tokens, end of sentence included, with ``c`` the dictionary's training
counts (``dict.TGT.txt``, or ``dict.txt`` for a language model), ``c(</s>)`` the number of training
sentences and an unseen token counted once. A model that ignores the source and the prefix reaches H;
a run whose best validation nll never gets below it has learnt nothing (``stalled``).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import DeepInitConfigError
from .candidates import Task


def unigram_bits(data: Path, task: Task) -> float:
    """H above, in bits per token, for the validation split of ``data``."""
    import logging

    from fairseq.data import Dictionary, data_utils

    logging.getLogger(data_utils.__name__).setLevel(logging.WARNING)  # "loaded N examples" is not the tool's news
    dictionary = Dictionary.load(str(task.target_dict(data)))
    train = data_utils.load_indexed_dataset(str(task.prefix(data, "train")), dictionary)
    valid = data_utils.load_indexed_dataset(str(task.prefix(data, "valid")), dictionary)
    if train is None or valid is None:
        raise DeepInitConfigError(f"{data}: no train and valid split of the target; give a fairseq-preprocess output")
    counts = [max(int(c), 0) for c in dictionary.count]
    for special in range(dictionary.nspecial):
        counts[special] = 0
    counts[dictionary.eos()] = len(train)
    total = sum(counts)
    bits = 0.0
    n = 0
    for i in range(len(valid)):
        for tok in valid[i].tolist():
            bits -= math.log2(max(counts[tok], 1) / total)
            n += 1
    return bits / max(n, 1)
