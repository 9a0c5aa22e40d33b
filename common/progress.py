"""Progress bars for long stages: tqdm on a terminal, a line every 30 s in a log, nothing when quiet."""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: seconds between progress lines when stderr is not a terminal (a log file, SLURM, nohup)
PROGRESS_SECONDS_ENV = "RETR_PROGRESS_SECONDS"
DEFAULT_PROGRESS_SECONDS = 30.0


class _Lines:
    """A file for tqdm that turns its carriage-return redraws into whole lines (for logs, not terminals)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(tqdm):
    """tqdm off a terminal: a line only when the count has moved since the last one, so a stage that waits (or a
    bar closed where its last line left it) never prints the same count twice."""

    def display(self, msg=None, pos=None):
        if msg is None and getattr(self, "_shown_n", None) == self.n:
            return True
        self._shown_n = self.n
        return super().display(msg, pos)


#: what the bars made inside :func:`stage` are part of (their description's prefix)
_stage: contextvars.ContextVar[str] = contextvars.ContextVar("retr_progress_stage", default="")


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Bars made inside are named as part of ``name`` (``validation: encode images``): a stage that reuses other
    stages' steps (an epoch's validation encodes and scores as evaluation does) says whose steps they are."""
    token = _stage.set(f"{_stage.get()}{name}: ")
    try:
        yield
    finally:
        _stage.reset(token)


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", quiet: bool = False, **kwargs) -> Iterator[T] | tqdm:
    """A tqdm bar (rate and ETA) on a terminal; elsewhere (stderr is a file or a pipe) one line of the same
    every ``RETR_PROGRESS_SECONDS`` seconds (default 30), the first after that long, so short stages print
    nothing, and never the same count twice; nothing at all with ``quiet``."""
    desc = _stage.get() + desc
    if quiet or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=quiet, dynamic_ncols=True,
                    smoothing=0.05, **kwargs)
    every = float(os.environ.get(PROGRESS_SECONDS_ENV, DEFAULT_PROGRESS_SECONDS))
    return _LogBar(iterable, total=total, desc=desc, unit=unit, file=_Lines(sys.stderr), mininterval=every,
                   maxinterval=max(every, 1.0), delay=every, ascii=True, ncols=100, smoothing=0.05, **kwargs)
