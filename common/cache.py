"""Where retr keeps what it remembers between commands for one user: ``$RETR_CACHE`` (default ``~/.cache/retr``),
one folder per purpose — the feature files already verified (``verified/``), the search caches of exports
(``search/``). Word vectors and weights keep their own variables (``RETR_WORD_VECTORS``, ``RETR_WEIGHTS``)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "RETR_CACHE"


def cache_folder(purpose: str) -> Path:
    """``$RETR_CACHE/<purpose>`` (default ``~/.cache/retr/<purpose>``); not created here."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "retr") / purpose
