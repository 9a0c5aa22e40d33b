"""Progress bars for long stages: tqdm on a terminal, a line every 30 s in a log, nothing when quiet."""
from __future__ import annotations

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


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", quiet: bool = False, **kwargs) -> Iterator[T] | tqdm:
    """A tqdm bar (rate and ETA) on a terminal; elsewhere (stderr is a file or a pipe) one line of the same
    every ``RETR_PROGRESS_SECONDS`` seconds (default 30), the first after that long, so short stages print
    nothing; nothing at all with ``quiet``."""
    if quiet or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=quiet, dynamic_ncols=True,
                    smoothing=0.05, **kwargs)
    every = float(os.environ.get(PROGRESS_SECONDS_ENV, DEFAULT_PROGRESS_SECONDS))
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=_Lines(sys.stderr), mininterval=every,
                maxinterval=max(every, 1.0), delay=every, ascii=True, ncols=100, smoothing=0.05, **kwargs)
