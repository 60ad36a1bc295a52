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
from typing import Any, Iterable

from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.sst_builder import PreparedLoad, build_sst
from dbidx.config import CacheConfig, prepare_dir
from dbidx.mdt.layout import validate_partition
from dbidx.mdt.records import FileRecord
from dbidx.mdt.table import Table
from dbidx.mdt.timeline import ACTION_ROLLBACK

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


def stage(cache_path: str | Path, instant: str, attempt: int | str,
          groups: Iterable[tuple[FileRecord, str, Any, Any]], config: CacheConfig) -> Path | None:
    """Write one task attempt's staged partitions: per (delta record, cache partition, keys, locations) one SST.

    Returns the staged directory, or None if there was nothing to stage. The directory appears complete or not at
    all (a private temp directory renamed into place).
    """
    root = staged_root(cache_path)
    prepare_dir(root.parent)
    root.mkdir(mode=0o700, exist_ok=True)
    tmp = root / f".tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(mode=0o700)
    try:
        staged = []
        for i, (record, partition, keys, locations) in enumerate(groups):
            prepared = build_sst(partition, keys, locations, tmp / f"{i:05d}.sst", config)
            if prepared.sst_path is None:
                continue
            staged.append(StagedPartition(partition, record.path, record.checksum, Path(prepared.sst_path).name,
                                          prepared.entries, prepared.locations, prepared.fills))
        if not staged:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        manifest = {"format": FORMAT, "instant": instant, "attempt": str(attempt),
                    "partitions": [asdict(s) for s in staged]}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        final = root / f"{instant}~{attempt}"
        os.rename(tmp, final)  # an attempt stages once: a leftover of the same name means a retry of the process
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def promote(cache: RecordIndexCache, table: Table, now_s: float | None = None) -> PromoteResult:
    """Install the staged partitions the table's completions confirm (see the module docstring), delete staged
    directories that can never be installed; leave those of instants still pending. The caller holds the cache
    open (its lock) and has refreshed the table."""
    result = PromoteResult([], [])
    root = staged_root(cache.path)
    if not root.is_dir():
        return result
    now = time.time() if now_s is None else now_s
    for entry in sorted(root.iterdir()):
        # 1. Temp directories of tasks that died mid-write go once nobody can still be writing them.
        if entry.name.startswith("."):
            if now - _mtime(entry) > ABANDONED_S:
                _discard(entry, result)
            continue
        try:
            staged = _read_manifest(entry)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("dbidx: staged load %s is unreadable (%s); discarded, the partitions load from the index",
                        entry, exc)
            _discard(entry, result)
            continue
        instant = staged[0]
        record = table.timeline.record_of(instant)
        # 2. Pending: keep (until it is clearly abandoned); rolled back: nothing of it is committed.
        if record is None:
            if now - _mtime(entry) > ABANDONED_S:
                _discard(entry, result)
            continue
        if record.action != ACTION_ROLLBACK:
            result.installed += _install(cache, table, record, entry, staged[1])
        _discard(entry, result)
    return result


def _install(cache: RecordIndexCache, table: Table, record: Any, entry: Path,
             partitions: list[StagedPartition]) -> list[str]:
    """Install each staged partition the record confirms and the cache lacks; returns those installed."""
    listed = {(f.path, f.checksum): f for f in record.files}
    shard = cache.identity.shard
    installed = []
    for staged in partitions:
        record_file = listed.get((staged.index_path, staged.checksum))
        if record_file is None or record_file.shard != shard or cache.is_ready(staged.partition):
            continue  # another attempt's files were committed, or the partition is there already
        group = None if cache.global_mode else staged.partition
        if record_file.partition != group or record_file.rows != staged.entries:
            continue
        live = table.refresh().files(group, shard, upto_seq=record.seq)
        if [f.path for f in live] != [staged.index_path]:
            continue  # the group held other files at that seq: the staged entries are not its whole state
        prepared = PreparedLoad(staged.partition, str(entry / staged.sst), list(staged.locations),
                                dict(staged.fills), staged.entries)
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
        if not (isinstance(staged.entries, int) and staged.entries > 0 and isinstance(staged.locations, list)
                and all(isinstance(v, str) for v in staged.locations) and isinstance(staged.fills, dict)
                and all(isinstance(v, int) for v in staged.fills.values())
                and sum(staged.fills.values()) == staged.entries
                and isinstance(staged.sst, str) and "/" not in staged.sst and not staged.sst.startswith(".")
                and (entry / staged.sst).is_file()):
            raise ValueError(f"staged partition {item!r:.120} is malformed")
        partitions.append(staged)
    return data["instant"], partitions


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _discard(entry: Path, result: PromoteResult) -> None:
    shutil.rmtree(entry, ignore_errors=True)
    result.discarded.append(entry.name)
