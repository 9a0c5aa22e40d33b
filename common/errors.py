"""Exceptions that the command-line front ends turn into one ``error: …`` line (no traceback); library code names
parameters, the commands their flags (docs/DESIGN.md, "Conventions")."""
from __future__ import annotations

import re

from typing import Iterable, Mapping


class RetrError(Exception):
    """Base class of every error retr reports to a user as a single line.

    ``parameters``: names of the Python parameters the message mentions (e.g. ``("trust_checkpoint",)`` in "… if you
    trust the file, set trust_checkpoint"); a command rewrites them as its flags. Empty by default."""

    def __init__(self, *args: object, parameters: Iterable[str] = ()):
        super().__init__(*args)
        self.parameters: tuple[str, ...] = tuple(parameters)


class ParameterError(ValueError):
    """A bad argument value given to a library function, the message naming the parameter, not a flag.

    ``ParameterError("image_size must be …", "image_size")``: ``parameters`` are the names the message mentions, the
    offending one first (:attr:`parameter`). A ``ValueError`` to Python callers."""

    def __init__(self, message: str, parameter: str, *others: str):
        super().__init__(message)
        self.message = message
        self.parameters: tuple[str, ...] = (parameter, *others)

    @property
    def parameter(self) -> str:
        """The parameter whose value is wrong."""
        return self.parameters[0]

    def __reduce__(self):  # keep the parameters across pickling (e.g. from a worker process)
        return type(self), (self.message, *self.parameters)


class UserError(RetrError):
    """The input is wrong (bad file, bad option combination, inconsistent data); the message says how."""


class MissingResourceError(RetrError):
    """A resource that cannot be downloaded here (weights, parser models, datasets) is absent.

    The message always has three parts: what is missing, where it was looked for, how to get it."""

    def __init__(self, what: str, looked_in: str | list[str], how: str):
        places = looked_in if isinstance(looked_in, str) else ", ".join(str(p) for p in looked_in)
        self.what, self.looked_in, self.how = what, places, how
        super().__init__(f"{what} not found (looked in {places}); {how}")


def with_flags(message: str, parameters: Iterable[str], flags: Mapping[str, str]) -> str:
    """``message`` with each whole-word occurrence of a name in ``parameters`` replaced by ``flags[name]``.

    Whole word: not part of a longer identifier, flag, dotted name or path (``half`` in ``half-precision``,
    ``self.half`` or ``/data/half/x`` stays). Names the command has no flag for stay as they are."""
    known = sorted((name for name in parameters if name in flags), key=len, reverse=True)
    if not known:
        return message
    pattern = re.compile(r"(?<![\w./\\-])(" + "|".join(map(re.escape, known)) + r")(?![\w/\\-])")
    return pattern.sub(lambda match: flags[match.group(1)], message)
