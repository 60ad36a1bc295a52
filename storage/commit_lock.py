"""Commit locks: for filesystems with neither an exclusive create nor a conditional put (HDFS through pyarrow, a
custom or in-memory filesystem), every writer of a table holds the same lock while it creates a file that must
exist only once (an instant claim, a completion record). The interface is a context manager; `FileCommitLock` is the
example implementation for a path every writer can reach (a POSIX filesystem, or NFS v4 with working locks).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any, Protocol, runtime_checkable

from dbidx.errors import ConfigError


@runtime_checkable
class CommitLock(Protocol):
    """What a commit lock must offer: mutual exclusion among all writers of a table, as a context manager. It must
    be picklable if Spark tasks write to the table (they do not take it: only the committing driver does)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> None: ...


class FileCommitLock:
    """An exclusive `lockf` on a file every writer can reach; waits up to timeout_s, then raises ConfigError."""

    def __init__(self, path: str, timeout_s: float = 120.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["timeout_s"])  # type: ignore[misc]

    def __enter__(self) -> "FileCommitLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return self
            except OSError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise ConfigError(
                        f"commit lock {self.path} is still held after {self.timeout_s:.0f} s; is another writer stuck?"
                    ) from None
                time.sleep(0.01)

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
