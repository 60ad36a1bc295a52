"""The TTL reaper: keeps a cache bounded by dropping cold partitions (O(1) each: drop the column family).

A cache holds committed entries only, all of them also in the index, so any partition may go, in two passes:
1. TTL: partitions not accessed for `partition_ttl_hours`;
2. budget: then least-recently-used partitions while the directory exceeds `max_disk_mb` (0 = no budget).
A dropped partition is simply reloaded on demand the next time a batch touches it.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dbidx.cache.dir_lock import incarnation, lock_path, read_incarnation, release_flock, try_flock
from dbidx.cache.key_file_sweep import sweep_stale_markers
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.staging import STAGED_SUFFIX, abandoned, remove as remove_staged
from dbidx.cache.store import directory_bytes
from dbidx.data.key_files import KEY_FILES_DIR, sweep_unused

log = logging.getLogger(__name__)


@dataclass
class ReapResult:
    """What one reaper pass dropped (or, in a dry run, would drop) and why."""

    dropped_ttl: list[str] = field(default_factory=list)
    dropped_budget: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    dry_run: bool = False

    @property
    def dropped(self) -> list[str]:
        """All partitions dropped by this pass."""
        return self.dropped_ttl + self.dropped_budget

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {**vars(self), "dropped": self.dropped}


def reap(
    cache: RecordIndexCache,
    ttl_hours: float | None = None,
    max_disk_mb: int | None = None,
    dry_run: bool = False,
    now_ms: int | None = None,
) -> ReapResult:
    """Drop expired partitions, then LRU partitions over the disk budget."""
    ttl = cache.config.partition_ttl_hours if ttl_hours is None else ttl_hours
    budget_mb = cache.config.max_disk_mb if max_disk_mb is None else max_disk_mb
    now = int(time.time() * 1000) if now_ms is None else now_ms
    result = ReapResult(dry_run=dry_run, bytes_before=cache.disk_bytes())
    states = cache.partitions()
    # 1. TTL pass, oldest first.
    cutoff = now - int(ttl * 3600 * 1000)
    by_age = sorted(states.values(), key=lambda s: s.last_access_ms)
    survivors = []
    for state in by_age:
        if state.last_access_ms < cutoff:
            result.dropped_ttl.append(state.partition)
        else:
            survivors.append(state)
    # 2. Budget pass: LRU among the survivors while the (estimated) size is over budget.
    if budget_mb > 0:
        sizes = {s.partition: cache.disk_bytes(s.partition) for s in survivors}
        total = result.bytes_before - sum(cache.disk_bytes(p) for p in result.dropped_ttl)
        for state in survivors:
            if total <= budget_mb << 20:
                break
            result.dropped_budget.append(state.partition)
            total -= sizes[state.partition]
    # 3. Drop (each is one column-family drop), unless this is a dry run.
    if not dry_run:
        for partition in result.dropped:
            cache.drop_partition(partition)
        if result.dropped:
            cache.flush()
        cache.metrics.add(evictions=len(result.dropped))
    result.bytes_after = cache.disk_bytes() if not dry_run else result.bytes_before
    return result


_SHARD_DIR = re.compile(r"^shard-\d{5}-of-\d{5}$")


@dataclass
class AbandonedCache:
    """A shard cache no live process holds and nobody opened for the TTL (a dead executor's leftover)."""

    path: str
    idle_hours: float
    disk_bytes: int


def _last_use_s(shard_dir: Path) -> float:
    """When a cache was last opened: the lock file is touched at every open; the directory's own mtime covers
    caches made before that (and a crash between mkdir and the first lock)."""
    times = []
    for probe in (lock_path(shard_dir), shard_dir):
        try:
            times.append(probe.stat().st_mtime)
        except FileNotFoundError:
            continue
    return max(times, default=0.0)


def sweep_abandoned(
    base_path: str | Path, ttl_hours: float, dry_run: bool = False, now_s: float | None = None
) -> list[AbandonedCache]:
    """Remove whole shard caches under a base path (`<base>/<table dir>/shard-*`) that no live process holds and
    nobody has opened for `ttl_hours`, and key files (data/key_files.py) nobody used for as long and writers' markers
    of them (cache/key_file_sweep.py) as old, then the table directories left empty.

    Why: an executor that died (or an application whose executors moved elsewhere) leaves its caches on the node's
    disk, and no task of theirs will ever open them again to run the per-partition TTL. A cache idle for the TTL
    would have lost every partition to that TTL anyway, so removing it whole loses nothing. "Held" is decided by
    the flock every opener takes: we take it ourselves, non-blocking, before deleting, so a cache in use (or one
    whose owner just came back) is never touched.
    """
    base = Path(base_path)
    now = time.time() if now_s is None else now_s
    cutoff = now - ttl_hours * 3600
    removed: list[AbandonedCache] = []
    if not base.is_dir():
        return removed
    for table_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink()):
        if not dry_run:
            sweep_staged(table_dir, now)
        for shard_dir in [p for p in _listing(table_dir) if p.is_dir() and _SHARD_DIR.match(p.name)]:
            # 1. Cheap filter first: recently opened caches are not candidates (no lock attempt needed).
            if _last_use_s(shard_dir) >= cutoff:
                continue
            if not ((shard_dir / "CURRENT").exists() or lock_path(shard_dir).exists()):
                continue  # not a cache dbidx made: never delete what we cannot recognise
            # 2. Take its lock without waiting: a live opener holds it, and then the cache is not abandoned.
            had_lock_file = lock_path(shard_dir).exists()
            fd = try_flock(lock_path(shard_dir))
            if fd is None:
                continue
            try:
                last = _last_use_s(shard_dir)  # re-read under the lock: an opener may have come and gone
                if last >= cutoff:
                    continue
                found = AbandonedCache(str(shard_dir), round((now - last) / 3600, 2), directory_bytes(shard_dir))
                if not dry_run:
                    _remove_locked(shard_dir)
                elif not had_lock_file:
                    lock_path(shard_dir).unlink(missing_ok=True)  # a dry run leaves no trace
                removed.append(found)
            finally:
                release_flock(fd)
        if not dry_run:
            sweep_unused(table_dir / KEY_FILES_DIR, cutoff)
            sweep_stale_markers(table_dir / KEY_FILES_DIR, cutoff)  # writers' markers (cache/key_file_sweep.py)
            try:
                table_dir.rmdir()  # only succeeds when empty
            except OSError:
                pass
    if removed and not dry_run:
        log.info("dbidx removed %d abandoned shard caches under %s", len(removed), base)
    return removed


def sweep_staged(table_dir: Path, now_s: float) -> list[str]:
    """Remove a table directory's staged loads (cache/staging.py) unchanged for staging.ABANDONED_S, and staging
    directories left empty; returns what went.

    Why here and by age: a bulk load stages beside a shard's cache without its lock (often before the cache even
    exists), and only a task opening that cache on this node installs or deletes it; when the shard's next tasks run
    elsewhere, nothing else would. A day-old staging is never needed (its partitions load from the index), and
    writers only ever touch fresh `.tmp-*` directories, so age is a safe test without the lock.
    """
    removed = []
    for staged in sorted(p for p in table_dir.glob(f"shard-*{STAGED_SUFFIX}") if p.is_dir() and not p.is_symlink()):
        for entry in _listing(staged):
            if abandoned(entry, now_s):
                remove_staged(entry)
                removed.append(str(entry))
        try:
            staged.rmdir()  # only succeeds when empty
        except OSError:
            pass
    return removed


def _listing(directory: Path) -> list[Path]:
    """A directory's entries, sorted; none when it is gone. Another process may remove it between our glob and our
    listing: a task that installs its staged load deletes the `.staged` directory, another reaper an emptied table
    directory. Housekeeping must not fail the task it runs in over that."""
    try:
        return sorted(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_locked(shard_dir: Path) -> None:
    """Delete a shard cache whose lock the caller holds: the directory, its SST staging, then the lock file while
    still holding it (openers re-check the inode they locked, see dir_lock.try_flock)."""
    shutil.rmtree(shard_dir)
    shutil.rmtree(str(shard_dir) + ".tmp", ignore_errors=True)  # SST scratch of its loads
    lock_path(shard_dir).unlink(missing_ok=True)


def discard_cache_dir(shard_dir: str | Path, seen: str | None) -> str:
    """Delete a damaged shard cache, the incarnation an opener saw (`seen`: its lock file's token, from
    `RecordIndexCache.lock_identity`), so its replacement is rebuilt from the index. Returns what happened, as a
    phrase for the error message: only that incarnation is ever deleted, and only under its lock."""
    shard_dir, lock = Path(shard_dir), lock_path(Path(shard_dir))
    # 1. Already gone or replaced (another attempt discarded it, maybe rebuilt it): nothing of ours to delete.
    if seen is None or read_incarnation(lock) != seen:
        return "already discarded by another opener"
    # 2. Under its lock, and still the same incarnation once we hold it.
    fd = try_flock(lock)
    if fd is None:
        return (
            "not discarded: another opener holds it now (it meets the same damage; if this error comes back, "
            f"delete {shard_dir} by hand)"
        )
    try:
        if incarnation(fd) != seen:
            return "already discarded by another opener"
        _remove_locked(shard_dir)
    except OSError as exc:
        log.error("dbidx could not discard the damaged cache %s: %s; delete it by hand", shard_dir, exc)
        return f"not discarded ({exc}): delete {shard_dir} by hand"
    finally:
        release_flock(fd)
    log.warning("dbidx discarded the damaged cache %s; it is rebuilt from the index", shard_dir)
    return "discarded; a retry rebuilds it from the index"


def abandoned_to_dict(found: list[AbandonedCache]) -> list[dict[str, Any]]:
    """JSON-friendly form."""
    return [asdict(a) for a in found]
