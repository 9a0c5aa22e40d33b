"""One writer per file or folder: exclusive ``fcntl.flock`` locks, released when their holder exits or dies.

The holder writes its pid, host and start time into the lock file, which stays in place (deleting it would let a
third process lock a new file). POSIX only."""
from __future__ import annotations

import fcntl
import json
import os
import socket
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from retr.common.errors import UserError


class LockHeldError(UserError):
    """Another process holds the lock; ``holder`` says who (``pid 12 on host h, started …``)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by {holder}")
        self.path, self.holder = path, holder


def describe_holder(text: str) -> str:
    """``pid 123 on host h, started 2026-11-24T15:40:01+00:00`` from a lock file's contents."""
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "pid unknown: it has only just started"


def acquire_lock(path: str | os.PathLike, create: bool = True, wait: bool = False) -> int | None:
    """Take the exclusive lock on the file ``path`` and record this process in it; returns the open descriptor
    (closing it releases the lock). With ``create=False`` a lock file that does not exist is not made and None
    is returned. Raises :class:`LockHeldError` when another process holds the lock, or with ``wait`` waits until
    it is released."""
    path = Path(path)
    if not create and not path.is_file():
        return None
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        holder = describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        os.close(fd)
        raise LockHeldError(path, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n").encode(), 0)
    return fd


@contextmanager
def exclusive_lock(path: str | os.PathLike, what: str,
                   advice: str = "wait for it to finish or choose another --out") -> Iterator[Path]:
    """Hold the lock on ``path`` (created with its folder if absent) for the ``with`` block; when another process
    holds it, :class:`UserError` in one line: ``{what} is in use by pid … on host …, started …; {advice}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = acquire_lock(path)
    except LockHeldError as exc:
        raise UserError(f"{what} is in use by {exc.holder}; {advice}") from None
    try:
        yield path
    finally:
        os.close(fd)


@contextmanager
def waiting_lock(path: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock on ``path`` (created with its folder if absent) for the ``with`` block, waiting while another
    process holds it: one downloader of a file at a time, the others then find it complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = acquire_lock(path, wait=True)
    try:
        yield path
    finally:
        os.close(fd)
