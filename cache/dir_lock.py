"""The directory lock of a shard cache: an flock on the side file `<dir>.lock`, held by the one opener.

RocksDB allows one read-write opener per directory and fails a second at once; the flock makes the second wait
its turn (two tasks of one shard on an executor), and lets the reaper and the damage path check "held by nobody"
before deleting a cache. The file's mtime is the cache's last open; its content names the directory's incarnation.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import Callable

from dbidx.errors import CacheBusyError, CacheError


def lock_path(cache_dir: Path) -> Path:
    """The side file whose flock guards a cache directory (`<dir>.lock`); its mtime is the cache's last open."""
    return Path(str(cache_dir) + ".lock")


def try_flock(path: Path) -> int | None:
    """Take the exclusive flock on `path` without waiting: the open fd, or None if someone holds it.

    The lock is on the file's inode, so a lock file removed and recreated by the abandoned-cache sweep between our
    open and our flock would leave us holding a lock nobody else can see: re-check that the path still names the
    inode we locked, and start over if not.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise CacheError(f"cannot lock cache directory {path}: {exc}") from exc
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def incarnation(lock_fd: int) -> str:
    """Which incarnation of a cache directory the holder of its lock file has: a random token the first opener
    writes into the (empty) lock file. A discarded cache's lock file is removed and its rebuild gets a new token;
    inode numbers are no such identity (a filesystem reuses them at once)."""
    token = os.pread(lock_fd, 64, 0).decode("ascii", "replace").strip()
    if not token:
        token = uuid.uuid4().hex
        os.pwrite(lock_fd, token.encode("ascii"), 0)
    return token


def read_incarnation(lock_file: Path) -> str | None:
    """The token in a lock file without taking the lock or creating the file (None: no such file)."""
    try:
        return lock_file.read_bytes()[:64].decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None


def release_flock(fd: int) -> None:
    """Give back a lock taken by try_flock."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def acquire_flock(path: Path, timeout_s: float, on_busy: Callable[[], object] | None = None) -> int:
    """Exclusive flock on a side file; waits up to timeout_s for another process to finish with the cache.
    `on_busy` runs once, the first time the lock is found held (the store asks a cache service to let go).

    Touches the file once locked: its mtime is when the cache was last opened, which is what the abandoned-cache
    sweep ages caches by.
    """
    deadline = time.monotonic() + max(timeout_s, 0)
    delay = 0.005
    while True:
        fd = try_flock(path)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.utime(fd)
            return fd
        if on_busy is not None:
            on_busy()
            on_busy = None
        if time.monotonic() >= deadline:
            raise CacheBusyError(
                f"cache {path.with_suffix('')} is in use by another opener (process or thread) for more than "
                f"{timeout_s:g} s: another task on this executor holding the same shard? Raise "
                "hoodie.index.cache.rocksdb.lock.timeout.s or give each job its own base.path"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
