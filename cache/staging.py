"""Staged loads: a bulk load's index entries, kept beside its shard's cache as finished SST files until the commit
is known, then ingested by the next catch-up instead of loading those partitions from the index again.

Why: a table's initial load (the bulk path, spark_integration/bulk.py) writes every key of a shard at once, and the
first batch after it found its cache empty: it loaded every partition it touched on demand, reading back the delta
files the load had just written (at 10 M keys, seconds of stalls). The load's tasks have those entries in memory,
so they also write each new partition's SST (the cache's own format, sst_builder.build_sst) into
`<shard dir>.staged/<instant>~<attempt>/`. Tasks never write the cache itself (a failed or losing attempt must leave
nothing a later batch could serve), so a staged directory is only a proposal: catch-up (`promote`) installs a staged
partition only when

1. the instant completed (not rolled back, not pending),
2. its completion record lists the staged delta file, same path (so: the same task attempt) and same checksum,
3. that file is the partition's whole index state at that completion (no other file of the (partition, shard)
   group is live at its seq), and
4. the cache does not hold the partition yet;

the partition is then ready at the completion's seq and catch-up applies whatever committed after it. Anything
else is deleted unread. Staged files live outside the RocksDB directory and are written without the shard's lock:
a task writes a private `.tmp-*` directory and renames it into place complete, and only renamed directories are read.
A damaged staged directory is discarded (it is a shortcut, never needed), with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dbidx.cache.base_dir import prepare_dir
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.sst_builder import PreparedLoad, build_sst
from dbidx.config import CacheConfig
from dbidx.errors import DbidxError
from dbidx.table.facade import Table
from dbidx.storage.index_view import IndexView
from dbidx.storage.layout import validate_partition
from dbidx.storage.records import ACTION_ROLLBACK, FileRecord

STAGED_SUFFIX = ".staged"
MANIFEST = "manifest.json"
FORMAT = 1
ABANDONED_S = 24 * 3600.0  # a staged dir of an instant still pending after this long, or a `.tmp-*` one, goes
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedPartition:
    """One partition's staged SST and the index delta file it mirrors."""

    partition: str  # the cache partition ("" in global mode: the whole shard)
    index_path: str  # the delta file the task wrote for the same entries
    checksum: str
    sst: str  # file name inside the staged directory
    entries: int
    locations: list[str]
    fills: dict[str, int]


@dataclass
class PromoteResult:
    """What one promotion pass did."""

    installed: list[str]
    discarded: list[str]  # staged directories deleted (installed, superseded, rolled back, damaged, abandoned)


def staged_root(cache_path: str | Path) -> Path:
    """Where a shard cache's staged loads live (beside its RocksDB directory, never inside it)."""
    return Path(str(cache_path) + STAGED_SUFFIX)


class StagedLoad:
    """One task attempt's staged partitions, written one SST at a time (as the task writes each delta file), then
    published complete by one rename; `abort` (or an error inside the `with` block) leaves nothing."""

    def __init__(self, cache_path: str | Path, instant: str, attempt: int | str, config: CacheConfig) -> None:
        self.root = staged_root(cache_path)
        self.instant, self.attempt, self.config = instant, str(attempt), config
        self.staged: list[StagedPartition] = []
        self.entries = 0
        self.seconds = 0.0  # building and publishing, summed (a task reports it as stage_seconds)
        self.failed: str | None = None  # why staging stopped (it never fails the load: the index has it all)
        self._tmp: Path | None = None

    def add(self, record: FileRecord, partition: str, keys: Any, locations: Any) -> None:
        """Stage one partition: the entries of delta file `record` (keys and their cache locations). A failure
        (no space, a cache base path that is not private, ...) stops the staging with a warning, never the task."""
        if self.failed is not None:
            return
        started = time.perf_counter()
        try:
            if self._tmp is None:
                prepare_dir(self.root.parent)
                self.root.mkdir(mode=0o700, exist_ok=True)
                self._tmp = self.root / f".tmp-{uuid.uuid4().hex[:12]}"
                self._tmp.mkdir(mode=0o700)
            prepared = build_sst(partition, keys, locations, self._tmp / f"{len(self.staged):05d}.sst", self.config)
        except (OSError, DbidxError) as exc:
            self._give_up(exc)
            return
        finally:
            self.seconds += time.perf_counter() - started
        if prepared.sst_path is not None:
            self.staged.append(
                StagedPartition(
                    partition,
                    record.path,
                    record.checksum,
                    Path(prepared.sst_path).name,
                    prepared.entries,
                    prepared.locations,
                    prepared.fills,
                )
            )
            self.entries += prepared.entries

    def publish(self) -> Path | None:
        """Write the manifest and move the directory into place; None if nothing was staged."""
        if self._tmp is None or self.failed is not None:
            return None
        if not self.staged:
            self.abort()
            return None
        manifest = {
            "format": FORMAT,
            "instant": self.instant,
            "attempt": self.attempt,
            "partitions": [asdict(s) for s in self.staged],
        }
        started = time.perf_counter()
        final = self.root / f"{self.instant}~{self.attempt}"
        try:
            (self._tmp / MANIFEST).write_text(json.dumps(manifest))
            os.rename(self._tmp, final)  # fails if the same attempt id staged before (a reused id): then it is lost
        except OSError as exc:
            self._give_up(exc)
            return None
        finally:
            self.seconds += time.perf_counter() - started
        self._tmp = None
        return final

    def _give_up(self, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        log.warning(
            "dbidx: staging the load's entries for the cache beside %s stopped (%s); the next batch loads "
            "those partitions from the index instead",
            self.root,
            self.failed,
        )
        self.abort()

    def abort(self) -> None:
        """Delete what was staged so far."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "StagedLoad":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.publish()
        else:
            self.abort()


def promote(
    cache: RecordIndexCache, table: Table, view: IndexView, upto_seq: int, now_s: float | None = None
) -> PromoteResult:
    """Install the staged partitions the table's completions up to `upto_seq` confirm (see the module docstring),
    delete staged directories that can never be installed; leave those of instants still pending (or completed
    after `upto_seq`). The caller holds the cache open (its lock); `view` is the table's index view it refreshed,
    folded at least to `upto_seq`. Never raises for a staged directory: whatever goes wrong with one (history
    cleaned since, a damaged SST, a stray file) discards it with a warning, and its partitions load from the index
    as if nothing had been staged."""
    result = PromoteResult([], [])
    root = staged_root(cache.path)
    if not root.is_dir():
        return result
    now = time.time() if now_s is None else now_s
    for entry in sorted(root.iterdir()):
        try:
            _promote_one(cache, table, view, upto_seq, entry, now, result)
        except (OSError, DbidxError) as exc:
            log.warning(
                "dbidx: staged load %s could not be installed (%s: %s); discarded, the partitions load from the index",
                entry,
                type(exc).__name__,
                exc,
            )
            _discard(entry, result)
    return result


def _promote_one(
    cache: RecordIndexCache,
    table: Table,
    view: IndexView,
    upto_seq: int,
    entry: Path,
    now: float,
    result: PromoteResult,
) -> None:
    """Install, keep or discard one staged directory."""
    # 1. Only directories are staged; temp directories of tasks that died mid-write go once nobody can still be
    #    writing them.
    if entry.is_symlink() or not entry.is_dir():
        _discard(entry, result)
        return
    if entry.name.startswith("."):
        if abandoned(entry, now):
            _discard(entry, result)
        return
    try:
        instant, partitions = _read_manifest(entry)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning(
            "dbidx: staged load %s is unreadable (%s); discarded, the partitions load from the index", entry, exc
        )
        _discard(entry, result)
        return
    # 2. Pending (or completed after the state this catch-up works to): keep, until it is clearly abandoned.
    record = table.timeline.record_of(instant)
    if record is None or record.seq > upto_seq:
        if abandoned(entry, now):
            _discard(entry, result)
        return
    # 3. Rolled back: nothing of it is committed. Completed: install what the record confirms, then discard.
    if record.action != ACTION_ROLLBACK:
        result.installed += _install(cache, view, record, entry, partitions)
    _discard(entry, result)


def _install(
    cache: RecordIndexCache, view: IndexView, record: Any, entry: Path, partitions: list[StagedPartition]
) -> list[str]:
    """Install each staged partition the record confirms and the cache lacks; returns those installed."""
    listed = {(f.path, f.checksum): f for f in record.files}
    shard = cache.shard
    installed = []
    for staged in partitions:
        record_file = listed.get((staged.index_path, staged.checksum))
        if record_file is None or record_file.shard != shard or cache.is_ready(staged.partition):
            continue  # another attempt's files were committed, or the partition is there already
        group = None if cache.global_mode else staged.partition
        if record_file.partition != group or record_file.rows != staged.entries or record_file.tombstones:
            continue
        # The staged entries are the group's whole state only if its delta is the group's one live file at that
        # seq (HistoryCompactedError if a clean removed that history since: the directory is discarded).
        if [f.path for f in view.files(group, shard, upto_seq=record.seq)] != [staged.index_path]:
            continue
        prepared = PreparedLoad(
            staged.partition, str(entry / staged.sst), list(staged.locations), dict(staged.fills), staged.entries
        )
        cache.install_partition(prepared, synced_seq=record.seq, durable=False)
        installed.append(staged.partition)
    if installed:
        cache.flush()
        cache.metrics.add(staged_loads=len(installed))
    return installed


def _read_manifest(entry: Path) -> tuple[str, list[StagedPartition]]:
    """(instant, partitions) of a staged directory, parsed strictly (it is read back from disk)."""
    data = json.loads((entry / MANIFEST).read_text())
    if data.get("format") != FORMAT or f"{data['instant']}~{data['attempt']}" != entry.name:
        raise ValueError(f"manifest of format {data.get('format')!r} for {data.get('instant')!r} does not match")
    partitions = []
    for item in data["partitions"]:
        staged = StagedPartition(**item)
        if staged.partition:
            validate_partition(staged.partition)
        if not (
            isinstance(staged.entries, int)
            and staged.entries > 0
            and isinstance(staged.locations, list)
            and all(isinstance(v, str) for v in staged.locations)
            and isinstance(staged.fills, dict)
            and all(isinstance(v, int) for v in staged.fills.values())
            and sum(staged.fills.values()) == staged.entries
            and isinstance(staged.sst, str)
            and "/" not in staged.sst
            and not staged.sst.startswith(".")
            and (entry / staged.sst).is_file()
        ):
            raise ValueError(f"staged partition {item!r:.120} is malformed")
        partitions.append(staged)
    return data["instant"], partitions


def abandoned(entry: Path, now_s: float) -> bool:
    """Whether a staged entry has not changed for ABANDONED_S (a writer only ever touches fresh ones)."""
    try:
        return now_s - entry.lstat().st_mtime > ABANDONED_S
    except OSError:
        return False  # gone meanwhile: nothing to remove


def remove(entry: Path) -> None:
    """Delete a staged entry: a directory with what is in it, anything else (a stray file, a link) itself."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _discard(entry: Path, result: PromoteResult) -> None:
    remove(entry)
    result.discarded.append(entry.name)
