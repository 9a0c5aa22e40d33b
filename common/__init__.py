"""Utilities shared by every part of retr (CLI, errors, hashing, versions); imports no other retr package."""
from retr.common.errors import MissingResourceError, RetrError, UserError
from retr.common.version import __version__

__all__ = ["MissingResourceError", "RetrError", "UserError", "__version__"]
