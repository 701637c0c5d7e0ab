"""Admin profile files (the two-step workflow: ``--admin-profile-only --admin-profile-path p.json``,
then ``--admin-profile-path p.json``): written atomically, checked against the model on load (depth,
dims, sub-layer rows, omega range) with one-line errors that name the file and the entry."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import List

import torch
import torch.nn as nn

from ..errors import AdminConfigError
from .residual import OMEGA_MAX, OMEGA_MIN, PROFILE_FORMAT, admin_residuals, model_shape

logger = logging.getLogger(__name__)


def _create_temporary(folder: str, stem: str) -> tuple:
    """A new file ``folder/stem.<pid>.<n>.tmp`` opened for writing: ``(fd, path)``.

    Not ``tempfile.mkstemp``: its files are mode 0600, and the profile renamed from it would lose
    the permissions a plain ``open`` gives (0666 minus the umask).
    """
    for n in range(100):
        tmp = os.path.join(folder, f"{stem}.{os.getpid()}.{n}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name {stem}.{os.getpid()}.N.tmp in {folder}")


def check_profile_destination(path: str) -> None:
    """Refuse, at start-up, a ``--admin-profile-only`` destination the profile could not be written to.

    Checked before any data is loaded or profiled, so that a run does not profile (or, under
    several ranks, wait for every rank) only to fail at the end. The parent folder is created if
    missing (as :func:`save_profile` does); writability is tested by creating and removing a probe
    file in it, which is what the write needs (a temporary file there, then an atomic rename) and,
    unlike ``os.access``, also sees read-only mounts and the rights of root.
    """
    if os.path.isdir(path):
        raise AdminConfigError(
            f"--admin-profile-path {path} is a folder; give the profile's file name, e.g. "
            f"--admin-profile-path {os.path.join(path, 'admin.json')}"
        )
    if os.path.exists(path) and not os.path.isfile(path):
        raise AdminConfigError(f"--admin-profile-path {path} exists and is not a regular file; give another path")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):  # the deepest folder that exists (the root always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise AdminConfigError(
            f"--admin-profile-path {path} cannot be written: {existing} is a file, not a folder; give another path"
        )
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = _create_temporary(folder, ".admin-profile-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise AdminConfigError(
            f"--admin-profile-path {path} cannot be written ({e.strerror or e} in {folder}); give a path in a "
            "writable folder"
        ) from e


def save_profile(profile: dict, path: str) -> None:
    """Write ``profile`` as JSON to ``path`` atomically: a temporary file in the same folder, then a rename.

    On any failure the temporary file is removed and :class:`AdminConfigError` names the path, so a
    half-written profile or a stray temporary file is never left behind.
    """
    check_profile_destination(path)  # also creates the folder
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temporary(folder, f".{os.path.basename(path)}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        raise AdminConfigError(f"cannot write the Admin profile to {path}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_profile(path: str) -> dict:
    if os.path.isdir(path):
        raise AdminConfigError(
            f"--admin-profile-path {path} is a folder, not a profile; give the profile's file name (written by "
            "--admin-profile-only)"
        )
    if not os.path.exists(path):
        raise AdminConfigError(
            f"Admin profile {path} not found. Write it first with --admin-profile-only --admin-profile-path "
            f"{path}, or drop --admin-profile-path to profile on the first batch of this run."
        )
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except (OSError, ValueError) as e:
        raise AdminConfigError(f"cannot read Admin profile {path}: {e}") from e
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise AdminConfigError(f"{path} is not an Admin profile written by this plugin (format {PROFILE_FORMAT!r})")
    return profile


def check_profile_rows(path: str, names: list, expected: List[str]) -> None:
    """The profile's sub-layer rows must be this model's sub-layers, each once, in forward order.

    The message names exactly the rows that are missing, unexpected or repeated (the depth and dims
    were already checked, so these are files edited by hand or written by another layer layout).
    """
    if names == expected:
        return
    present, wanted = set(names), set(expected)
    problems = []
    missing = [n for n in expected if n not in present]
    unexpected = [str(n) for n in dict.fromkeys(names) if n not in wanted]
    repeated = [str(n) for n in dict.fromkeys(names) if n in wanted and names.count(n) > 1]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)}")
    if repeated:
        problems.append(f"repeated {', '.join(repeated)}")
    if not problems:
        start = ", ".join(expected[:3])
        problems.append(f"the same sub-layers in another order (this model's forward order starts {start})")
    raise AdminConfigError(
        f"Admin profile {path} does not match this model's sub-layers: {'; '.join(problems)}. "
        "Re-profile this model with --admin-profile-only."
    )


def check_omega(path: str, name, w) -> float:
    """One profile row's omega as a float in [OMEGA_MIN, OMEGA_MAX] (see there why), else a one-line error."""
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise AdminConfigError(
            f"Admin profile {path}: omega of {name} is {w!r}, not a finite number; re-profile with --admin-profile-only"
        )
    if not OMEGA_MIN <= w <= OMEGA_MAX:
        raise AdminConfigError(
            f"Admin profile {path}: omega of {name} is {w!r}, outside [{OMEGA_MIN:g}, {OMEGA_MAX:g}] (profiled omegas "
            "are near 1 and grow like sqrt(depth); see docs/admin.md); re-profile with --admin-profile-only"
        )
    return float(w)


def apply_profile(model: nn.Module, profile: dict, formula: str, path: str = "profile") -> None:
    """Set omega from a profile after checking that it was made for this model's depth and dims."""
    residuals = admin_residuals(model)
    if not residuals:
        raise AdminConfigError("this model has no Admin omega to load a profile into; use --arch admin_<size>")
    shape = model_shape(model)
    for key, value in shape.items():
        if profile.get(key) != value:
            raise AdminConfigError(
                f"Admin profile {path} was made for {key.replace('_', ' ')} = {profile.get(key)}, but this model "
                f"has {value}. Re-profile this model with --admin-profile-only, or fix --encoder-layers/"
                "--decoder-layers/--*-embed-dim."
            )
    rows = profile.get("sublayers")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise AdminConfigError(
            f"Admin profile {path} has no list of sub-layer rows; re-profile with --admin-profile-only"
        )
    check_profile_rows(path, [r.get("name") for r in rows], list(residuals))
    if profile.get("formula") != formula:
        raise AdminConfigError(
            f"Admin profile {path} was computed with --admin-formula {profile.get('formula')}, but this run asks for "
            f"--admin-formula {formula}; pass --admin-formula {profile.get('formula')} or re-profile"
        )
    values = [check_omega(path, row.get("name"), row.get("omega")) for row in rows]
    with torch.no_grad():
        for m, w in zip(residuals.values(), values, strict=True):
            m.omega.fill_(w)
            m.mark_profiled()
