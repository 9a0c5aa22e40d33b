"""Exceptions that the command-line front ends turn into one ``error: …`` line (no traceback)."""
from __future__ import annotations


class RetrError(Exception):
    """Base class of every error retr reports to a user as a single line."""


class UserError(RetrError):
    """The input is wrong (bad file, bad option combination, inconsistent data); the message says how."""


class MissingResourceError(RetrError):
    """A resource that cannot be downloaded here (weights, parser models, datasets) is absent.

    The message always has three parts: what is missing, where it was looked for, how to get it.
    """

    def __init__(self, what: str, looked_in: str | list[str], how: str):
        places = looked_in if isinstance(looked_in, str) else ", ".join(str(p) for p in looked_in)
        self.what, self.looked_in, self.how = what, places, how
        super().__init__(f"{what} not found (looked in {places}); {how}")
