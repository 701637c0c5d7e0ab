"""The data a GPU session carries, prepared here, and the size of what the device command carries.

The device has no network and no ``../shared``: everything the stages read travels in the command's
``carry`` (:data:`CARRY`): the wheels of ``../shared/tools/device-wheels.sh`` in ``.device/`` and the
prepared data in ``.carry/`` (:func:`prepare`):

- ``.carry/m30k``: the converged matrix's Multi30k (joint BPE 8000, binarised; ``multi30k_matrix.py
  prepare``), without what the cells never read (the BPE training text, the German raw text);
- ``.carry/bench/multi30k-de-en-word-all``: the speed rows' word-level Multi30k (``throughput.py``);
- the CPU rehearsal's small versions: ``.carry/bench/multi30k-de-en-word-2000`` (``--quick``) and
  ``.carry/m30k-quick`` (:data:`QUICK_TRAIN` training pairs, :data:`QUICK_EVAL` of each dev/test set,
  binarised with the full data's dictionaries).

The device command carries the working tree too (tracked and untracked-not-ignored files): all of it
must stay under :data:`CARRY_LIMIT` (:func:`carried_bytes`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterable

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import multi30k
from deepinit_tools.paths import REPO

CARRY = (".device", ".carry")  # the run call's carry
CARRY_LIMIT = 64 * 2**20
MERGES = 8000
QUICK_TRAIN, QUICK_EVAL = 1000, 100
# the files of the prepared matrix data the cells read: binarised data, the English references (and
# train.en, whose line count the unigram baseline needs), the BPE'd dev targets (the unigram baseline)
CELL_FILES = ("bin", "raw/train.en", "raw/valid.en", "raw/test.en", "raw/test1.en", f"bpe{MERGES}/valid.en")
SPLITS = ("train", "valid", "test", "test1")


def cells_data(carry: Path, quick: bool) -> Path:
    """The prepared cells' data under ``carry`` (``m30k``, or ``m30k-quick`` for the rehearsal)."""
    return carry / ("m30k-quick" if quick else "m30k")


def speed_data(carry: Path, quick: bool) -> Path:
    """The speed rows' binarised corpus (what ``throughput.py --work-dir CARRY/bench`` reads)."""
    return carry / "bench" / f"multi30k-de-en-word-{2000 if quick else 'all'}"


def prepare(
    carry: Path,
    multi30k_dir: str | Path | None = None,
    work: Path | None = None,
    merges: int = MERGES,
    device: bool = True,
) -> Dict[str, Path]:
    """Prepare the data folders a session reads under ``carry`` and return them: the device's
    (``device``) and the rehearsal's. ``work``: where the full BPE data is made (default: the matrix's
    work dir, reused when it is there)."""
    corpus = multi30k.locate(multi30k_dir)
    full = work or REPO / "work-data" / "multi30k-matrix"
    multi30k.prepare_bpe(full, merges, corpus)
    made = {"cells (rehearsal)": _quick_cells(full, cells_data(carry, quick=True), merges)}
    made["speed (rehearsal)"] = multi30k.binarize_multi30k(corpus, speed_data(carry, True), {"train": ("train", 2000)})
    if device:
        out = made["cells"] = cells_data(carry, quick=False)
        for rel in CELL_FILES:
            _copy(full / rel, out / rel)
        made["speed"] = multi30k.binarize_multi30k(corpus, speed_data(carry, False), {"train": ("train", None)})
    return made


def _copy(src: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dest) if src.is_dir() else shutil.copy2(src, dest)


def _head(src: Path, dest: Path, n: int) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(src, encoding="utf-8") as f, open(dest, "w", encoding="utf-8") as g:
        for i, line in enumerate(f):
            if i >= n:
                break
            g.write(line)


def _quick_cells(full: Path, dest: Path, merges: int) -> Path:
    """The rehearsal's cells data: the first pairs of every split, the full data's dictionaries."""
    if (dest / "bin" / ".done").exists():
        return dest
    bpe = f"bpe{merges}"
    for split in SPLITS:
        n = QUICK_TRAIN if split == "train" else QUICK_EVAL
        for lang in ("de", "en"):
            _head(full / bpe / f"{split}.{lang}", dest / bpe / f"{split}.{lang}", n)
        _head(full / "raw" / f"{split}.en", dest / "raw" / f"{split}.en", n)
    b = dest / bpe
    dicts = ["--srcdict", str(full / "bin" / "dict.de.txt"), "--tgtdict", str(full / "bin" / "dict.en.txt")]
    cmd = fa.preprocess(b / "train", dest / "bin", valid=b / "valid", tests=[b / "test", b / "test1"], extra=dicts)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise multi30k.Multi30kError(f"fairseq-preprocess of {dest} failed: {done.stderr.strip()[-300:]}")
    (dest / "bin" / ".done").write_text("ok\n")
    return dest


def _tree_bytes(paths: Iterable[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_symlink() or not p.exists():
            continue
        total += p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def carried_bytes(root: Path = REPO, carry: Iterable[str] = CARRY) -> Dict[str, int]:
    """Bytes the device command would carry: the working tree (tracked and untracked-not-ignored
    files, as ``git ls-files -co --exclude-standard`` lists them) and each ``carry`` path."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    tree = _tree_bytes(root / name for name in listed.split("\0") if name)
    sizes = {"working tree": tree}
    for name in carry:
        sizes[name] = _tree_bytes([root / name])
    sizes["total"] = sum(sizes.values())
    return sizes
