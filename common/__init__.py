"""Utilities shared by every part of retr (CLI conventions, errors, hashing, versions).

Nothing here imports another retr subpackage, so `extractors` and `parsers` may depend on it freely.
"""
from retr.common.errors import MissingResourceError, RetrError, UserError
from retr.common.version import __version__

__all__ = ["MissingResourceError", "RetrError", "UserError", "__version__"]
