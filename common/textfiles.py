"""Reading a text file a user named, with one-line errors for the wrong kind of file.

Users hand retr the wrong file often enough (a feature set where a label file goes, a Latin-1 export of a caption
file) that every text reader should say what it got instead of raising ``UnicodeDecodeError``: :func:`read_utf8`
names a binary format by its signature, or the line and byte that are not UTF-8."""
from __future__ import annotations

import os
from pathlib import Path

from retr.common.errors import UserError

#: Leading bytes of files a text argument may be given by mistake.
BINARY_SIGNATURES = {b"\x89HDF": "an HDF5 file", b"PK\x03\x04": "a zip file (.npz, .pth, …)",
                     b"\x93NUMPY": "a NumPy .npy file", b"\x80": "a pickle"}


def binary_kind(head: bytes) -> str | None:
    """What a file starting with ``head`` is when it is a binary format rather than text (else None)."""
    for signature, kind in BINARY_SIGNATURES.items():
        if head.startswith(signature):
            return kind
    return "binary data" if b"\0" in head[:4096] else None


def read_utf8(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of ``path``, which should be ``what`` (e.g. ``"a label file (JSON)"``); a missing path,
    a folder, a binary file or a non-UTF-8 byte is a :class:`UserError` in one line."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not {what}")
    if not path.is_file():
        raise UserError(f"{path} does not exist (expected {what})")
    raw = path.read_bytes()
    kind = binary_kind(raw[:4096])
    if kind is not None:
        raise UserError(f"{path} is {kind}, not {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path} line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); {what} is UTF-8 — "
                        "re-encode it (e.g. iconv -f latin1 -t utf-8)") from None
