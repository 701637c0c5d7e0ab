"""The benchmark harness: one way to time, compare, measure memory and report, for every script.

- :func:`interleave` (``timing``): rounds of every case, start rotating (:func:`rotation`), warm-up;
  :class:`Rounds` gives per-round rates and paired ratios against a baseline; :class:`Stat`
  median [min-max].
- ``memory``: :func:`peak` (CPU RSS growth / CUDA ``max_memory_allocated``), :func:`cpu_peak_in_fork`.
- ``report``: :func:`environment` (device, date, command, versions), :func:`markdown_table`,
  :func:`write_json`, :func:`write_markdown`, :func:`provenance`.
- ``cli``: :class:`Parser` (every default in --help; one-line errors, exit 1).
- ``counters``: CPU stand-ins for a GPU in one import (``harness.counters``): host reads
  (``host_reads``), kernel launches and matmul dtypes (``op_counters``), attention paths
  (``attention_calls``), graph breaks and the meta device;
- ``flops``: model FLOPs of a training step and MFU; ``multi30k``: the data; ``fairseq_tools`` and
  ``fairseq_train``: fairseq as a child process or in-process.
"""

from .cli import Parser, fail, int_list, nonnegative_int, positive_int
from .memory import cpu_peak_in_fork, cuda_peak, peak
from .report import environment, markdown_table, provenance, write_json, write_markdown
from .timing import Clocks, Rounds, Stat, interleave, median, paired_ratios, rotation

__all__ = [
    "Clocks", "Parser", "Rounds", "Stat", "cpu_peak_in_fork", "cuda_peak", "environment", "fail", "int_list",
    "interleave", "markdown_table", "median", "nonnegative_int", "paired_ratios", "peak", "positive_int",
    "provenance", "rotation", "write_json", "write_markdown",
]  # fmt: skip
