"""One writer per folder: an exclusive OS file lock, released when its holder exits or dies.

``fcntl.flock`` locks belong to the open file: the kernel drops them when the process ends, however it ends
(``kill -9`` included), so a lock can never be left stale. The lock file holds a line naming the holder (PID,
host, start time) for the message the next process gets; the file itself stays in place (deleting it would let
a third process lock a new file while the second still holds the old one).

POSIX only (Linux and macOS), as the rest of retr's tooling.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from retr.common.errors import UserError


def holder_line() -> str:
    """``"PID 1234 on host gpu07 since 2026-11-24 15:40:01"`` for this process."""
    return f"PID {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"


@contextmanager
def exclusive_lock(path: str | os.PathLike, what: str, advice: str = "wait for it to finish or choose another "
                   "--out") -> Iterator[Path]:
    """Hold an exclusive lock on the file ``path`` (created if absent) for the ``with`` block.

    When another process holds it, raise :class:`UserError` in one line: ``{what} is in use by PID … on host …
    since …; {advice}``. Yields the lock file's path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            raise UserError(f"{what} is in use by {holder}; {advice}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder_line() + "\n").encode("utf-8"), 0)
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
