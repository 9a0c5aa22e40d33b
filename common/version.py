"""The installed version of retr, recorded in every file the project writes."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("retr")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
