"""NumPy arrays and scalars of numeric dtypes in a checkpoint, loaded as data: no numpy code runs on the file's say-so.

fairseq's ``--eval-bleu`` logs its BLEU n-gram counts as numpy arrays (``fairseq/tasks/translation.py``,
``reduce_metrics``, lines 416-417: ``metrics.log_scalar("_bleu_counts", np.array(counts))``), and
fairseq-train saves the meters' state in every checkpoint (``extra_state["metrics"]``,
``fairseq/trainer.py`` line 426). Such a file pickles, besides ``argparse.Namespace``, the globals
``numpy._core.multiarray._reconstruct``, ``numpy.ndarray`` and ``numpy.dtype`` (numpy 1.x:
``numpy.core.multiarray._reconstruct``; a numpy scalar adds ``numpy._core.multiarray.scalar``), which torch's
``weights_only`` loader refuses.

Allow-listing those numpy globals (what torch suggests for numpy arrays: ``add_safe_globals`` of
``_reconstruct``, ``ndarray``, ``dtype`` and each ``numpy.dtypes.*DType`` class, pytorch/pytorch#134346) would
hand the file numpy's own unpickling code: ``ndarray.__setstate__`` and ``dtype.__setstate__`` take whatever
the pickle says. An object dtype makes an array of arbitrary pickled objects, and ``dtype.__setstate__`` sets
the dtype's internal flags from the file: an ``int64`` dtype whose flags claim that it holds Python object
pointers (tests/test_numpy_data.py builds one).

Instead, while the plugin loads a checkpoint (:func:`loading`), torch's allow-list maps those four names to
stand-ins of this module: :class:`_DTypeRecord`, :class:`_ArrayRecord`, :class:`_ScalarRecord` and
:class:`_NDArrayName`. torch's unpickler calls and builds them where it would call numpy, and they only record
their arguments; no numpy code runs during the load. Then :func:`restore` replaces every record by the numpy
object it describes, built by the plugin from checked values only: a dtype code of :data:`NUMERIC_CODES`
(``bool``, ``int8``-``int64``, ``uint8``-``uint64``, ``float16``-``float64``, ``complex64``/``complex128``)
with the state numpy writes for it (byte order ``<``, ``>``, ``|`` or ``=``, no fields, subarray, metadata or
flags), a shape of non-negative ints and exactly ``prod(shape) * itemsize`` bytes, read with
``numpy.frombuffer`` and copied. Anything else (an object, structured, string or datetime dtype, another
state, ``numpy.ndarray`` called directly) raises :class:`NumpyDataRefused`, naming it, which the plugin's
loaders report as the usual refusal (:func:`fairseq_deepinit.checkpoints.compat.refused_file_error`). Every
other global stays as torch decides: refused unless it is ``argparse.Namespace``.

The stand-ins are on torch's allow-list only for the duration of such a load (one at a time in a process:
the list is process-wide), so a plain ``torch.load`` elsewhere behaves as without the plugin. A load
that created no record returns its result untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pickle
import reprlib
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, TypeVar

import numpy as np
import torch

T = TypeVar("T")

# dtype codes as numpy pickles them (``np.dtype(t).__reduce__()[1][0]``): the plain numeric dtypes
NUMERIC_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
DESCRIPTION = "numpy arrays and scalars of numeric dtypes"
_NATIVE = "<" if sys.byteorder == "little" else ">"  # numpy pickles the native byte order as this character

LOCK = threading.RLock()  # torch's allow-list is process-wide: one plugin load at a time
_local = threading.local()  # .created: the records of the load in progress on this thread


class NumpyDataRefused(pickle.UnpicklingError):
    """A checkpoint's numpy data is not a plain numeric array or scalar; ``names`` says what it is."""

    def __init__(self, names: List[str]) -> None:
        self.names = names
        super().__init__(f"numpy data refused: {', '.join(names)}")


class _Record:
    """What the unpickler made of one numpy call: its arguments and the state BUILD gave it, nothing else."""

    __slots__ = ("args", "state")

    def __new__(cls, *args: Any) -> _Record:  # also torch's NEWOBJ path, which skips __init__
        self = super().__new__(cls)
        self.args, self.state = None, None
        created = getattr(_local, "created", None)
        if created is not None:
            created.append(self)
        return self

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _DTypeRecord(_Record):
    """``numpy.dtype(code, align, copy)`` and its state."""

    __slots__ = ()


class _ArrayRecord(_Record):
    """``numpy._core.multiarray._reconstruct(ndarray, (0,), b"b")`` and the array's state."""

    __slots__ = ()


class _ScalarRecord(_Record):
    """``numpy._core.multiarray.scalar(dtype, raw_bytes)``."""

    __slots__ = ()


class _NDArrayName(_Record):
    """``numpy.ndarray``: only ever an argument of ``_reconstruct``; an instance means the file called it."""

    __slots__ = ()


# the names numpy's pickles use (numpy 2 and 1.x), each mapped to its stand-in
STAND_INS = [
    (_DTypeRecord, "numpy.dtype"),
    (_NDArrayName, "numpy.ndarray"),
    (_ArrayRecord, "numpy._core.multiarray._reconstruct"),
    (_ArrayRecord, "numpy.core.multiarray._reconstruct"),
    (_ScalarRecord, "numpy._core.multiarray.scalar"),
    (_ScalarRecord, "numpy.core.multiarray.scalar"),
]
GLOBAL_NAMES = tuple(name for _, name in STAND_INS)

_brief = reprlib.Repr()
_brief.maxstring, _brief.maxother, _brief.maxtuple, _brief.maxlevel = 24, 24, 9, 2


def _shown(value: Any) -> str:
    return _brief.repr(value).replace("\n", " ")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _dtype(rec: Any) -> np.dtype:
    """The numpy dtype a :class:`_DTypeRecord` describes, if it is a plain numeric one."""
    if type(rec) is not _DTypeRecord:
        raise NumpyDataRefused([f"{_shown(rec)} as a numpy dtype"])
    args, state = rec.args, rec.state
    if not (type(args) is tuple and len(args) == 3 and type(args[0]) is str and args[0] in NUMERIC_CODES):
        shown = _shown(args[0]) if type(args) is tuple and len(args) == 3 else "" if args is None else _shown(args)
        raise NumpyDataRefused([f"numpy.dtype({shown})"])
    code = args[0]
    flags_ok = all(type(a) in (bool, int) for a in args[1:]) and not args[1] and args[2]
    ok = (
        flags_ok
        and type(state) is tuple
        and len(state) in (8, 9)
        and _is_int(state[0])
        and state[0] == len(state) - 5  # version 3 without metadata, 4 with
        and state[1] in ("<", ">", "|", "=")
        and all(s is None for s in state[2:5])  # subarray, names, fields
        and all(_is_int(s) for s in state[5:8])
        and state[5:8] == (-1, -1, 0)  # elsize, alignment, flags as numpy writes them for a numeric dtype
        and (len(state) == 8 or state[8] is None)  # metadata
    )
    if not ok:
        raise NumpyDataRefused([f"numpy.dtype({code!r}) with the state {_shown(state)}"])
    dt = np.dtype(code)
    return dt.newbyteorder(state[1]) if state[1] in ("<", ">") and state[1] != _NATIVE else dt


def _array(rec: _ArrayRecord) -> np.ndarray:
    args, state = rec.args, rec.state
    if not (type(args) is tuple and len(args) == 3 and args[0] is _NDArrayName):
        raise NumpyDataRefused([f"numpy._core.multiarray._reconstruct{_shown(args)}"])
    if not (type(state) is tuple and len(state) == 5 and _is_int(state[0]) and state[0] == 1):
        raise NumpyDataRefused([f"a numpy array with the state {_shown(state)}"])
    _, shape, dtype_rec, fortran, raw = state
    dt = _dtype(dtype_rec)
    if not (type(shape) is tuple and len(shape) <= 32 and all(_is_int(n) and n >= 0 for n in shape)):
        raise NumpyDataRefused([f"a numpy array of shape {_shown(shape)}"])
    if not (type(fortran) is bool and type(raw) is bytes and len(raw) == math.prod(shape) * dt.itemsize):
        what = f"{len(raw)} bytes" if type(raw) is bytes else _shown(raw)
        raise NumpyDataRefused([f"a numpy array of dtype {dt.str!r} and shape {shape} from {what}"])
    try:
        return np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if fortran else "C").copy(order="K")
    except (ValueError, OverflowError, MemoryError) as e:
        raise NumpyDataRefused([f"a numpy array of shape {_shown(shape)} ({e})"]) from None


def _scalar(rec: _ScalarRecord) -> np.generic:
    args = rec.args
    if not (type(args) is tuple and len(args) == 2 and rec.state is None):
        raise NumpyDataRefused([f"numpy._core.multiarray.scalar{_shown(args)}"])
    dt = _dtype(args[0])
    if not (type(args[1]) is bytes and len(args[1]) == dt.itemsize):
        raise NumpyDataRefused([f"a numpy scalar of dtype {dt.str!r} from {_shown(args[1])}"])
    return np.frombuffer(args[1], dtype=dt)[0]


def _to_numpy(rec: _Record) -> Any:
    if type(rec) is _ArrayRecord:
        return _array(rec)
    if type(rec) is _ScalarRecord:
        return _scalar(rec)
    if type(rec) is _DTypeRecord:
        return _dtype(rec)
    raise NumpyDataRefused([f"numpy.ndarray{_shown(rec.args) if type(rec.args) is tuple else '()'} called"])


_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.Tensor)


class _Restorer:
    """Replaces records in dicts (any subclass), lists, tuples, sets and ``argparse.Namespace``, in place where
    the container is mutable; shared objects stay shared, cycles are followed once."""

    def __init__(self) -> None:
        self.done: Dict[int, Any] = {}
        self.refused: List[str] = []

    def visit(self, obj: Any) -> Any:
        if isinstance(obj, _ATOMS):
            return obj
        key = id(obj)
        if key in self.done:
            return self.done[key]
        if isinstance(obj, _Record):
            try:
                self.done[key] = _to_numpy(obj)
            except NumpyDataRefused as e:
                self.refused += [n for n in e.names if n not in self.refused]
                self.done[key] = None
            return self.done[key]
        self.done[key] = obj  # before descending: a container that holds itself
        if isinstance(obj, dict):
            old = list(obj.items())
            new = [(self.visit(k), self.visit(v)) for k, v in old]
            if any(k is not k0 for (k, _), (k0, _) in zip(new, old, strict=True)):
                obj.clear()  # a record as a key: the dict is rebuilt in its order
            for (k, v), (_, v0) in zip(new, old, strict=True):
                if v is not v0 or k not in obj:
                    obj[k] = v  # the subclass's own __setitem__ (OrderedDict, Counter, defaultdict)
        elif isinstance(obj, list):
            obj[:] = [self.visit(x) for x in obj]
        elif isinstance(obj, argparse.Namespace):
            self.visit(vars(obj))
        elif type(obj) in (tuple, set, frozenset):
            items = [self.visit(x) for x in obj]
            if any(a is not b for a, b in zip(items, obj, strict=True)):
                if type(obj) is set:
                    obj.clear()
                    obj.update(items)
                else:
                    self.done[key] = type(obj)(items)
        return self.done[key]


def restore(obj: Any) -> Any:
    """``obj`` (what a load under :func:`loading` returned) with every record replaced by its numpy object.

    Raises :class:`NumpyDataRefused` naming every record that is not a plain numeric array, scalar or dtype.
    """
    r = _Restorer()
    out = r.visit(obj)
    if r.refused:
        raise NumpyDataRefused(r.refused)
    return out


@contextlib.contextmanager
def _standing_in() -> Iterator[List[_Record]]:
    with LOCK:
        outer = getattr(_local, "created", None)
        created: List[_Record] = []
        _local.created = created
        try:
            if outer is None and hasattr(torch.serialization, "safe_globals"):
                with torch.serialization.safe_globals(STAND_INS):
                    yield created
            else:
                yield created
        finally:
            _local.created = outer


def loading(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a ``torch.load`` or fairseq code that calls one, with numpy data accepted as data.

    The stand-ins are allow-listed while ``fn`` runs; its result comes back through :func:`restore` when the
    load created records, unchanged otherwise.
    """
    with _standing_in() as created:
        result = fn(*args, **kwargs)
    return restore(result) if created else result


def load(f: Any, **kwargs: Any) -> Any:
    """``torch.load(f, **kwargs)`` under :func:`loading`."""
    return loading(torch.load, f, **kwargs)
