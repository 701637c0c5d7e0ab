"""One line for bad data and generation options that stock fairseq 0.12.3 ends with a traceback.

Each is a self-contained wrapper of one fairseq function (fairseq's own its first argument), installed by
:mod:`fairseq_deepinit.patches` when the plugin is imported; for input fairseq accepts, nothing changes, for a
stock model as for the plugin's:

- :func:`setup_task` (``fairseq/tasks/__init__.py``, line 24): a translation or language-modeling task
  without a data folder (``fairseq-hydra-train`` without ``task.data``: ``TypeError: argument of type
  'NoneType' is not iterable`` in ``utils.split_paths``).
- :func:`add_from_file` (``Dictionary.add_from_file``, ``fairseq/data/dictionary.py``, line 231): a
  dictionary that lists a word twice (``RuntimeError: Duplicate word found ...``, which names neither
  the file nor the line, and mentions Camembert).
- :func:`filter_indices_by_size` (``FairseqTask.filter_indices_by_size``, ``fairseq/tasks/fairseq_task.py``,
  line 168): a validation or test sentence longer than the model's positions (``Exception: Size of
  sample #4 is invalid ...``); fairseq already skips such training sentences with a warning.
- :func:`build_generator` (``FairseqTask.build_generator``, line 374): ``--beam`` below 1 (a reshape
  error inside the first search step), and ``--max-len-a 0`` with ``--max-len-b`` below ``--min-len``
  (``AssertionError: min_len cannot be larger than max_len``), checked before any sentence is read.
- :func:`generation_main` (the ``main`` of ``fairseq_cli/generate.py``, line 28, and ``interactive.py``, line
  108): ``--sampling`` with ``--nbest`` other than ``--beam`` (``AssertionError: --sampling requires --nbest to
  be equal to --beam``, generate.py:34-36, interactive.py:122-124, asserted before ``build_generator``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Callable

from fairseq.data import Dictionary
from fairseq.tasks import TASK_REGISTRY, FairseqTask
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

from .errors import DataConfigError, DeepInitConfigError

logger = logging.getLogger(__name__)

MISSING = "???"  # omegaconf's mandatory value that was never given


def setup_task(original: Callable, cfg: Any, **kwargs: Any) -> Any:
    """fairseq's ``tasks.setup_task`` after checking that a translation or language-modeling task has a data folder."""
    name = getattr(cfg, "task", None)
    name = name if isinstance(name, str) else getattr(cfg, "_name", None)
    task_cls = TASK_REGISTRY.get(name) if isinstance(name, str) else None
    if task_cls is not None and issubclass(task_cls, (TranslationTask, LanguageModelingTask)):
        try:
            data = cfg.get("data", "") if hasattr(cfg, "get") else getattr(cfg, "data", "")
        except Exception:  # omegaconf's MissingMandatoryValue for a "???" it cannot leave unset
            data = None
        if data is None or data == MISSING:
            raise DataConfigError(
                f"--task {name} has no data folder: give the output of fairseq-preprocess (fairseq-train DATA ..., "
                "or task.data=DATA for fairseq-hydra-train)"
            )
    return original(cfg, **kwargs)


_DUPLICATE = re.compile(r"Duplicate word found when loading Dictionary: '(.*)'\. Duplicate words")


def _lines_of(path: str, word: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            return [i for i, line in enumerate(f, 1) if line.rstrip("\n").rsplit(" ", 1)[0] == word]
    except OSError:
        return []


def add_from_file(original: Callable, self: Dictionary, f: Any) -> None:
    """fairseq's ``Dictionary.add_from_file``; a word listed twice in the file ``f`` is one line naming both lines."""
    try:
        return original(self, f)
    except RuntimeError as e:
        m = _DUPLICATE.search(str(e))
        if m is None or not isinstance(f, (str, os.PathLike)):
            raise
        word, lines = m.group(1), _lines_of(os.fspath(f), m.group(1))
        where = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
        raise DataConfigError(
            f"dictionary {os.fspath(f)} lists the word {word!r} twice{where}: every word once. Use the dictionary "
            "fairseq-preprocess wrote, or end the later line with ' #fairseq:overwrite' to keep that one"
        ) from None


def filter_indices_by_size(
    original: Callable, self: FairseqTask, indices, dataset, max_positions=None, ignore_invalid_inputs=False
):
    """fairseq's ``FairseqTask.filter_indices_by_size``; a sentence beyond ``max_positions`` is one line."""
    try:
        return original(self, indices, dataset, max_positions, ignore_invalid_inputs)
    except Exception as e:
        m = re.match(r"Size of sample #(\d+) is invalid", str(e))
        if m is None:
            raise
        split = next((k for k, v in getattr(self, "datasets", {}).items() if v is dataset), "a")
        size = dataset.size(int(m.group(1)))
        raise DataConfigError(
            f"sentence {m.group(1)} of the {split} split has {_sizes(size)} tokens, more than the model's positions "
            f"{_sizes(max_positions)} (--max-source-positions / --max-target-positions, or --tokens-per-sample). "
            "Add --skip-invalid-size-inputs-valid-test to leave such sentences out, or shorten them"
        ) from None


def _sizes(value: Any) -> str:
    """``6 / 6`` for a (source, target) pair, ``6`` for one number (numpy integers included)."""
    if isinstance(value, (tuple, list)):
        return " / ".join(_sizes(v) for v in value)
    return str(int(value)) if value is not None else "unlimited"


@dataclass(frozen=True)
class GenerationOptions:
    """fairseq's generation options the checks read, with fairseq's defaults (``GenerationConfig``,
    ``fairseq/dataclass/configs.py``, the line in each comment), typed as fairseq declares them. The values are
    taken as given, not converted: the checks still test each type, and leave to fairseq what they cannot compare."""

    beam: int = 5  # configs.py:811
    nbest: int = 1  # configs.py:819
    max_len_a: float = 0  # configs.py:823
    max_len_b: int = 200  # configs.py:829
    min_len: int = 1  # configs.py:847
    sampling: bool = False  # configs.py:910

    @classmethod
    def of(cls, args: Any) -> GenerationOptions:
        """The options of ``args`` (fairseq's Namespace or its ``generation`` config); one it lacks has the default."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})


def check_generation(args: Any) -> None:
    """Refuse generation options that leave beam search nothing to do."""
    opts = GenerationOptions.of(args)
    beam = opts.beam
    if isinstance(beam, int) and beam < 1:
        raise DeepInitConfigError(
            f"--beam {beam}: beam search needs at least one hypothesis; give --beam 1 (greedy) or more"
        )
    a, b, low = opts.max_len_a, opts.max_len_b, opts.min_len
    if isinstance(a, (int, float)) and isinstance(b, int) and a < 0:
        raise DeepInitConfigError(f"--max-len-a {a}: the output length limit cannot grow negatively with the source")
    if a == 0 and isinstance(b, int) and isinstance(low, int) and b < low:
        raise DeepInitConfigError(
            f"--max-len-b {b} (with --max-len-a {a}) leaves no room for --min-len {low} output token(s); give "
            f"--max-len-b >= {low} (fairseq's default is 200), or --max-len-a > 0 to scale it with the source length"
        )


def check_sampling(args: Any) -> None:
    """``--sampling``: fairseq's ``Sampling`` search (``fairseq/search.py``, line 699) draws one token per beam from
    the first step on, so each sentence gets ``--beam`` independent samples, and fairseq prints all of them
    (``--nbest`` must equal ``--beam``)."""
    opts = GenerationOptions.of(args)
    beam, nbest = opts.beam, opts.nbest
    if opts.sampling and isinstance(beam, int) and isinstance(nbest, int) and nbest != beam:
        raise DeepInitConfigError(
            f"--sampling with --beam {beam} draws {beam} independent samples per sentence, and fairseq prints all "
            f"of them (--nbest must equal --beam; got --nbest {nbest}): give --nbest {beam} --beam {beam}, or "
            f"--nbest {nbest} --beam {nbest}"
        )


def generation_main(original: Callable, cfg: Any, *rest: Any, **kwargs: Any) -> Any:
    """The ``main`` of fairseq-generate and fairseq-interactive after :func:`check_sampling` (``cfg``: their
    Namespace, or the config whose ``generation`` node has the options); the rest waits for :func:`build_generator`."""
    check_sampling(getattr(cfg, "generation", None) or cfg)
    return original(cfg, *rest, **kwargs)


def build_generator(original: Callable, self: FairseqTask, models, args, *rest: Any, **kwargs: Any) -> Any:
    """fairseq's ``FairseqTask.build_generator`` after :func:`check_generation`."""
    check_generation(args)
    return original(self, models, args, *rest, **kwargs)
