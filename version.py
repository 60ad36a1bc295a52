"""The installed dbidx's version (`dbidx.__version__`, `dbidx --version`), apart from the front door so that the
CLI can read it without importing the library's top."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dbidx")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
