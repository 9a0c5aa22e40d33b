"""Shard writes on a background thread (:class:`BackgroundWriter`), so the network never waits on the disk.

Order, failures and kill safety: docs/extraction.md ("Modules")."""
from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable

import numpy as np

#: batches that may wait for the disk before the extraction loop blocks
WRITE_QUEUE_DEPTH = 3


class BackgroundWriter:
    """``append`` / ``add_error`` of ``writer`` run on one thread, in call order, at most ``depth`` queued
    (``depth=0``: run at once in the caller's thread)."""

    def __init__(self, writer: Any, depth: int = WRITE_QUEUE_DEPTH):
        if depth < 0:
            raise ValueError(f"depth must be 0 or more, not {depth}")
        self.writer = writer
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max(depth, 1))
        self._error: BaseException | None = None
        self._dropping = False
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._run, name="retr-shard-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            if self._error is not None or self._dropping:
                continue
            try:
                call()
            except BaseException as exc:  # handed to the main thread, which decides
                self._error = exc

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._dropping = True   # nothing after a failed call is written
            raise error

    def _put(self, call: Callable[[], None]) -> None:
        self._raise_pending()
        if self._thread is None:
            call()
        else:
            self._queue.put(call)

    def append(self, ids: list[str], features: np.ndarray, **extras: np.ndarray) -> None:
        """Queue :meth:`ShardWriter.append` (the arrays must not be changed afterwards)."""
        self._put(functools.partial(self.writer.append, ids, features, **extras))

    def add_error(self, image_id: str, reason: str) -> None:
        """Queue :meth:`ShardWriter.add_error`."""
        self._put(functools.partial(self.writer.add_error, image_id, reason))

    def close(self) -> None:
        """Wait until every queued call has run; re-raise the first failure."""
        self._stop()
        self._raise_pending()

    def abandon(self) -> None:
        """Drop the queued calls and stop the thread (after an exception in the main thread)."""
        self._dropping = True
        self._stop()

    def _stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

