"""The paths a command is given, checked before any work, each mistake in one line that names the option.

* inputs are named for what they are (:func:`check_input`): a path that does not exist, a folder where a file is
  expected, a file where a folder is — each in its own words;
* outputs can be made and written (:func:`check_output_folder`, :func:`check_output_file`): not a file where a
  folder goes (nor below one), not a folder where a file goes, and the folder that would hold them accepts a new
  file — tried by creating and removing an empty one, since permission bits say nothing for root and nothing of a
  read-only file system or ``/proc``;
* a folder a command fills with its own layout (a run, a report, a dataset) is new, empty or already one of its
  kind (:func:`check_folder_holds_only`), unless the user says to write among other files.

Every function raises :class:`~retr.common.errors.UserError` and writes nothing (the probe file is removed at
once). ``name`` is how the message names the path: the option a command takes it with (``--out``), an
argument's metavar (``RUN``), or words (``the run folder``).
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from retr.common.errors import UserError

#: the prefix of the empty file :func:`write_problem` creates and removes to learn whether a folder takes files
PROBE_PREFIX = ".retr-write-check-"
#: what an ``OSError`` of creating a file says about the folder, by ``errno``
_REASONS = {errno.EROFS: "a read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "disk quota exceeded", errno.ENOENT: "it takes no new files"}


def kind_of(path: str | os.PathLike) -> str:
    """``"folder"``, ``"file"`` (anything else that exists, a device too) or ``"absent"``."""
    path = Path(path)
    return "folder" if path.is_dir() else "file" if path.exists() else "absent"


def check_input(path: str | os.PathLike, name: str, kind: str = "file", what: str | None = None,
                holds: str | None = None) -> Path:
    """``path`` when it exists and is a ``kind`` (``file``, ``folder``, or ``any``: either); else one line: ``NAME P
    does not exist``, ``NAME P is a folder, not WHAT`` or ``NAME P is a file, not WHAT`` (``what``: e.g. ``a
    feature set (.h5 file)``; default ``a file`` / ``a folder``). ``holds``: a file name a folder must hold (a
    run's ``config.json``): ``NAME P holds no config.json, so it is not WHAT``."""
    if kind not in ("file", "folder", "any"):
        raise ValueError(f"kind must be 'file', 'folder' or 'any', not {kind!r}")
    path = Path(path)
    found = kind_of(path)
    if kind == "any" and found != "absent":
        kind = found
    what = what or f"a {kind}"
    if found == "absent":
        if path.is_symlink():
            raise UserError(f"{name} {path} is a link to {os.readlink(path)}, which does not exist")
        raise UserError(f"{name} {path} does not exist (expected {what})")
    if found != kind:
        raise UserError(f"{name} {path} is a {found}, not {what}")
    if holds is not None and not (path / holds).is_file():
        raise UserError(f"{name} {path} holds no {holds}, so it is not {what}")
    return path


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` or its nearest ancestor that exists (``.`` for a relative path whose first part is absent)."""
    path = Path(path)
    while not path.exists() and not path.is_symlink():
        if path.parent == path:
            break
        path = path.parent
    return path


def write_problem(folder: str | os.PathLike) -> str | None:
    """Why no file can be created in the existing ``folder`` (``a read-only file system``, ``permission
    denied`` …), or None when one can: tried by creating an empty file and removing it."""
    try:
        handle, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=folder)
    except OSError as exc:
        return _REASONS.get(exc.errno, (exc.strerror or type(exc).__name__).lower())
    os.close(handle)
    os.unlink(probe)
    return None


def _check_can_make(target: Path, name: str, given: Path, what: str) -> None:
    """``target`` (a folder, or the folder a file goes into) exists and takes files, or can be made."""
    existing = nearest_existing(target)
    if not existing.exists():                     # a link to nowhere
        raise UserError(f"{name} {given}: {existing} is a link to {os.readlink(existing)}, which does not exist")
    if not existing.is_dir():
        raise UserError(f"{name} {given}: {existing} is a file, so {what} cannot be made there")
    problem = write_problem(existing)
    if problem is not None:
        raise UserError(f"{name} {given}: cannot write in {existing} ({problem})")


def check_output_folder(folder: str | os.PathLike, name: str = "--out") -> Path:
    """``folder`` when a command can make it (or it exists) and write into it; else one line naming ``name``:
    a file there, a file on the way, or a folder that takes no files (read-only, no permission, ``/proc``)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{name} {folder} is a file, not a folder")
    _check_can_make(folder, name, folder, "the folder")
    return folder


def check_output_file(path: str | os.PathLike, name: str = "--out") -> Path:
    """``path`` when a command can write the file (new, or replacing one); else one line naming ``name``: a
    folder there, a file on the way, or a folder that takes no files."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{name} {path} is a folder, not a file")
    if str(path).endswith(os.sep) or str(path) in ("", "."):
        raise UserError(f"{name} {path} names a folder, not a file")
    _check_can_make(path.parent, name, path, "the file")
    if path.is_file() and not os.access(path, os.W_OK):
        raise UserError(f"{name} {path} is read-only")
    return path


def check_folder_holds_only(folder: str | os.PathLike, name: str, what: str, is_own: Callable[[Path], bool],
                            allow_flag: str | None = "--allow-nonempty-out", ignore: Iterable[str] = ()) -> None:
    """Refuse an existing, non-empty ``folder`` that is not ``what`` (``is_own(folder)`` false) in one line:
    a command would write its files among the user's. ``ignore``: names that do not count (a lock file).
    ``allow_flag``: the option that writes there anyway, named in the message."""
    folder = Path(folder)
    if not folder.is_dir() or is_own(folder):
        return
    skipped = set(ignore)
    entries = sorted(p.name for p in folder.iterdir() if p.name not in skipped)
    if not entries:
        return
    shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
    how = "; give a new or empty folder" + (f", or {allow_flag} to write among them" if allow_flag else "")
    raise UserError(f"{name} {folder} is not empty and is not {what} ({len(entries)} "
                    f"entr{'ies' if len(entries) != 1 else 'y'}: {shown}){how}")
