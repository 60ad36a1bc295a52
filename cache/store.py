"""The storage seam: one RocksDB directory opened through rocksdict, with its column families and options.

Why these options: the cache is a disposable replica, so the WAL is off (writes cost a memtable insert only);
`atomic_flush` keeps every column family flushed at the same point, so after a kill -9 the directory holds a
consistent (if older) state across the registry and the partitions, which catch-up then moves forward. The
directory is guarded by an flock on `<dir>.lock` besides RocksDB's own LOCK (cache/dir_lock.py). Every read's
error is typed here (`read_failure`): damage is a CacheCorruptError, never a shorter answer.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterator

import rocksdict as rd

from dbidx.cache.base_dir import make_private_dirs
from dbidx.cache.service_link import request_release
from dbidx.cache.dir_lock import acquire_flock, incarnation, lock_path, release_flock
from dbidx.config import CacheConfig
from dbidx.errors import CacheCorruptError, CacheError

DEFAULT_CF = "default"
_COMPRESSION = {
    "zstd": rd.DBCompressionType.zstd(),
    "lz4": rd.DBCompressionType.lz4(),
    "snappy": rd.DBCompressionType.snappy(),
    "none": rd.DBCompressionType.none(),
}


# Level-0 files of a family at which closing the store compacts it (RocksDB's own trigger, 4 by default, is when its
# background compaction starts; see Store.compact_piled_up).
L0_COMPACT_AT = 4
MEMTABLES_MB = 64
_BLOCK_CACHES: dict[int, rd.Cache] = {}
_BLOCK_CACHES_LOCK = threading.Lock()


def shared_block_cache(size_mb: int) -> rd.Cache | None:
    """One block cache per size per process, shared by every cache directory it opens.

    Why: Spark tasks open a shard's directory for one task only (docs/DESIGN.md), and Python workers are reused;
    a cache per open would throw the index, filter and data blocks away after every task. Blocks are keyed by
    SST file identity, so one LRU serves all shards and all reopenings in the worker, and the memory stays
    bounded by block.cache.mb per worker instead of per open directory.
    """
    if not size_mb:
        return None
    with _BLOCK_CACHES_LOCK:
        cache = _BLOCK_CACHES.get(size_mb)
        if cache is None:
            cache = _BLOCK_CACHES[size_mb] = rd.Cache(size_mb << 20)
        return cache


def column_family_options(config: CacheConfig, block_cache: rd.Cache | None) -> rd.Options:
    """rocksdict options for the DB and every column family (they must agree, incl. raw_mode)."""
    opts = rd.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    opts.set_atomic_flush(True)
    opts.set_max_open_files(config.max_open_files or -1)
    opts.set_compression_type(_COMPRESSION[config.compression])
    opts.set_bottommost_compression_type(_COMPRESSION[config.compression])
    opts.set_keep_log_file_num(2)
    opts.set_max_background_jobs(2)
    opts.set_skip_stats_update_on_db_open(True)  # reopened once per Spark task: don't read every file's stats
    # All families' memtables together stay under this (then RocksDB flushes): a cache service holds a directory
    # open for many sessions, and each family's own limit (64 MiB, two of them) times 30 families is gigabytes.
    opts.set_db_write_buffer_size(MEMTABLES_MB << 20)
    if config.compaction_style == "universal":
        opts.set_compaction_style(rd.DBCompactionStyle.universal())
    table = rd.BlockBasedOptions()
    table.set_block_size(config.block_size_kb * 1024)
    if config.bloom_bits_per_key > 0:
        table.set_bloom_filter(config.bloom_bits_per_key, False)
    if block_cache is not None:
        table.set_block_cache(block_cache)
    else:  # SST writers need none; block.cache.mb = 0 means none at all
        table.disable_cache()
    if not config.block_cache_mb:  # without a cache, index and filter blocks stay whole in the table readers
        opts.set_block_based_table_factory(table)
        return opts
    # Index and filter blocks live in the (bounded) block cache, partitioned in 4 KB pieces under a pinned top
    # level. Why: a bulk-loaded partition is one SST whose whole-file filter (10 bits/key: 1.25 MB per M keys)
    # and index compete with data blocks; once a partition's SST outgrows the cache, random lookups evicted and
    # reloaded them over and over (measured, 64 MB cache, 100 k-key batch: 1 M-entry partition 0.6 s -> 0.17 s,
    # 10 M entries 6.5 s -> 0.54 s; at 333 k entries, when all fits, ~10 % slower; +0.3 % disk). Reading the
    # index type and filter layout from each SST's properties, RocksDB reads older whole-filter SSTs as before.
    table.set_index_type(rd.BlockBasedIndexType.two_level_index_search())
    table.set_partition_filters(True)
    table.set_metadata_block_size(4096)
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_top_level_index_and_filter(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    return opts


class Store:
    """An open RocksDB directory: column families by name, writes without WAL, exclusive per process."""

    def __init__(self, path: Path, config: CacheConfig) -> None:
        self.path = Path(path)
        self.config = config
        self._lock_fd: int | None = None
        self.lock_identity: str | None = None  # kept after close: the incarnation of the directory it held
        self._cache = shared_block_cache(config.block_cache_mb)
        self.options = column_family_options(config, self._cache)
        self._cfs: dict[str, rd.Rdict] = {}
        self._handles: dict[str, Any] = {}
        self.db: rd.Rdict | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def open(self) -> "Store":
        """Take the directory lock (waiting up to lock_timeout_s) and open RocksDB with all its column families."""
        make_private_dirs(self.path.parent)
        # A cache service holding the directory (cache/service_link.py) is asked to let go; then we wait as usual.
        self._lock_fd = acquire_flock(
            lock_path(self.path), self.config.lock_timeout_s, on_busy=lambda: request_release(self.path)
        )
        try:
            self.lock_identity = incarnation(self._lock_fd)
            existing = rd.Rdict.list_cf(str(self.path), self.options) if (self.path / "CURRENT").exists() else []
            families = {name: self.options for name in existing if name != DEFAULT_CF}
            self.db = rd.Rdict(str(self.path), self.options, column_families=families or None)
            write_opts = rd.WriteOptions()
            write_opts.disable_wal = True
            self.db.set_write_options(write_opts)
            os.chmod(self.path, 0o700)
            with contextlib.suppress(OSError):  # best effort: the 0700 directory keeps the files private anyway
                self.make_files_private()
        except Exception as exc:
            self._release()
            raise read_failure(exc, f"opening RocksDB cache at {self.path}") from exc
        return self

    def close(self) -> None:
        """Flush everything (data first, registry last), compact the families whose level 0 piled up
        (`compact_piled_up`), drop handles, close the DB, release the lock."""
        if self.db is None:
            return
        try:
            self.flush()
            self.compact_piled_up()
        finally:
            self._cfs.clear()
            self._handles.clear()
            try:
                self.db.close()
            finally:
                self.db = None
                with contextlib.suppress(OSError):
                    self.make_files_private()
                self._release()

    def make_files_private(self) -> None:
        """chmod 0600 every file RocksDB created (it creates them 0644 less the umask; changing the process umask
        would also change the table's data files a task writes). The directory is 0700 in any case."""
        for entry in os.scandir(self.path):
            try:  # RocksDB's background threads create and delete files meanwhile: a vanished file is fine
                if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mode & 0o077:
                    os.chmod(entry.path, 0o600)
            except FileNotFoundError:
                continue

    def _release(self) -> None:
        if self._lock_fd is not None:
            release_flock(self._lock_fd)
            self._lock_fd = None

    # ---- column families ---------------------------------------------------------------------------------
    def column_families(self) -> list[str]:
        """Names of the non-default column families on disk."""
        assert self.db is not None
        return [n for n in rd.Rdict.list_cf(str(self.path), self.options) if n != DEFAULT_CF]

    def cf(self, name: str, create: bool = False) -> rd.Rdict:
        """The Rdict view of a column family; a missing one is created only when asked (never on a read path)."""
        assert self.db is not None
        if name == DEFAULT_CF:
            return self.db
        view = self._cfs.get(name)
        if view is None:
            try:
                view = self.db.get_column_family(name)
            except Exception as exc:
                if not create:
                    raise CacheError(f"column family {name!r} is missing from cache {self.path}") from exc
                try:
                    view = self.db.create_column_family(name, self.options)
                except Exception as exc2:
                    raise CacheError(f"cannot create column family {name!r} in {self.path}: {exc2}") from exc2
            self._cfs[name] = view
        return view

    def handle(self, name: str) -> Any:
        """The column family handle for WriteBatch puts."""
        assert self.db is not None
        if name not in self._handles:
            self.cf(name, create=True)
            self._handles[name] = self.db.get_column_family_handle(name)
        return self._handles[name]

    def drop(self, name: str) -> None:
        """Drop a column family: O(1), its files are deleted by RocksDB."""
        assert self.db is not None
        self._cfs.pop(name, None)
        self._handles.pop(name, None)
        try:
            self.db.drop_column_family(name)
        except Exception as exc:
            if "Invalid column family" not in str(exc) and "not found" not in str(exc).lower():
                raise CacheError(f"cannot drop column family {name!r} in {self.path}: {exc}") from exc

    # ---- writes ------------------------------------------------------------------------------------------
    def batch(self) -> rd.WriteBatch:
        """A write batch; apply with write() (atomic across column families)."""
        return rd.WriteBatch(raw_mode=True)

    def write(self, batch: rd.WriteBatch) -> None:
        """Apply a write batch (no WAL); disk errors become CacheError naming the directory."""
        assert self.db is not None
        try:
            self.db.write(batch)
        except Exception as exc:
            raise CacheError(f"write to cache {self.path} failed: {exc}") from exc

    def ingest(self, name: str, sst_paths: list[str]) -> None:
        """Move SST files into a column family (no memtable, durable at once)."""
        opts = rd.IngestExternalFileOptions()
        opts.set_move_files(True)
        try:
            self.cf(name).ingest_external_file(sst_paths, opts)
        except Exception as exc:  # rocksdict raises a bare Exception (e.g. no space left on the device)
            raise CacheError(
                f"ingesting {len(sst_paths)} SST file(s) into {name!r} in {self.path} failed: {exc}"
            ) from exc

    def create_from_sst(self, name: str, sst_path: str | Path | None) -> None:
        """Create a column family holding exactly one SST's content (empty if None); the SST file is gone after
        it either way, and a failed ingest leaves no family behind."""
        try:
            self.cf(name, create=True)
            try:
                if sst_path is not None:
                    self.ingest(name, [str(sst_path)])
            except BaseException:
                self.drop(name)
                raise
        finally:
            if sst_path is not None:
                Path(sst_path).unlink(missing_ok=True)

    def flush(self, registry_too: bool = True) -> None:
        """Persist memtables: every partition column family first, the registry (default) last.

        With the WAL off this is what makes writes survive a crash; the order guarantees the registry never
        claims more than the data holds. Only families opened in this session can hold unflushed writes (every
        write goes through cf() or handle()), and families with empty memtables are skipped, so a flush costs
        O(dirty families), not O(partitions).
        """
        assert self.db is not None
        try:
            for view in list(self._cfs.values()):
                if _has_memtable_data(view):
                    view.flush(True)
            if registry_too and _has_memtable_data(self.db):
                self.db.flush(True)
        except Exception as exc:
            raise CacheError(f"flushing cache {self.path} failed (disk full?): {exc}") from exc

    def compact_piled_up(self) -> list[str]:
        """Compact (synchronously, into the bottom level) each family opened in this session whose level 0 holds
        L0_COMPACT_AT files or more; returns their names.

        Why: a family's level-0 files are a large catch-up's ingested SST (each key's change, over what the family
        holds) or a session's flushed write batch, each overlapping the family's bottom level, so every one of them
        is bytes on top of one copy of the entries. RocksDB compacts them in the background once
        `level0_file_num_compaction_trigger` (4) are there, but a Spark task holds the cache for one task only, and
        closing the DB aborts a compaction that is running: with short sessions the files piled up (measured: a
        40 k-entry family re-pointed by 17 k entries per session, opened and closed at once, held 2 to 6 level-0
        files, 1.4x to 3.2x its fresh size; compacted here it stays within 1.4x). The cost is a rewrite of one
        family (a partition's slice of one shard) once per L0_COMPACT_AT sessions that wrote it, at close.
        """
        assert self.db is not None
        compacted = []
        for name, view in list(self._cfs.items()):
            try:
                if (view.property_int_value("rocksdb.num-files-at-level0") or 0) < L0_COMPACT_AT:
                    continue
                view.compact_range(None, None)
            except Exception as exc:  # rocksdict raises a bare Exception (e.g. no space left on the device)
                raise CacheError(
                    f"compacting column family {name!r} of cache {self.path} failed (disk full?): {exc}"
                ) from exc
            compacted.append(name)
        return compacted

    def disk_bytes(self, name: str | None = None) -> int:
        """SST bytes on disk of one column family, or of the whole directory."""
        if name is None:
            return directory_bytes(self.path)
        value = self.cf(name).property_int_value("rocksdb.total-sst-files-size")
        return int(value or 0)


MULTI_GET_CHUNK = 512


def multi_get(view: rd.Rdict, keys: list[bytes], chunk: int = MULTI_GET_CHUNK) -> list[bytes | None]:
    """Values of many keys (None where absent), fetched in chunks of `chunk` keys.

    rocksdict's multi-get costs more per key as the list grows (measured on a 1 M-entry family, sorted keys:
    1.4 us/key in one call of 150 k keys, 0.8 us/key in calls of 256-4096), so big batches are split.
    """
    try:
        if len(keys) <= chunk:
            return view[keys] if keys else []
        values: list[bytes | None] = []
        for start in range(0, len(keys), chunk):
            values += view[keys[start : start + chunk]]
        return values
    except Exception as exc:  # rocksdict raises a bare Exception
        raise read_failure(exc, f"reading {len(keys)} keys from a cache column family") from exc


def get(view: rd.Rdict, key: bytes) -> bytes | None:
    """One key's value (None if absent), read errors typed by read_failure."""
    return multi_get(view, [key])[0]


def scan(view: rd.Rdict, from_key: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) of a column family in key order (from `from_key`); a read error is raised, typed by
    read_failure.

    Why not `view.items()`: on a checksum failure RocksDB invalidates the iterator and rocksdict's items() simply
    ends, so a damaged file would read as a family with fewer (or no) entries. The raw iterator's status() says
    whether it ended or failed (measured: 0.33 vs 0.18 s per M entries; no lookup path scans).
    """
    iterator = None
    try:
        iterator = view.iter()
        iterator.seek_to_first() if from_key is None else iterator.seek(from_key)
        while iterator.valid():
            yield iterator.key(), iterator.value()
            iterator.next()
        iterator.status()  # raises the error that ended the iteration, if one did
    except Exception as exc:  # rocksdict raises a bare Exception
        raise read_failure(exc, "scanning a cache column family") from exc
    finally:
        del iterator  # a live iterator keeps the DB's LOCK after close


# RocksDB's own files (the manifest CURRENT names, a table file the manifest lists, the options file) missing.
_OWN_FILE_MISSING = re.compile(
    r"^IO error: No such file or directory: .*/(MANIFEST-\d+|\d+\.sst|OPTIONS-\d+)"
    r"(: No such file or directory)?$"
)


def read_failure(exc: Exception, what: str) -> CacheError:
    """A RocksDB read error as a typed one: a checksum or format failure ("Corruption: ..." names the file), or one
    of the directory's own files gone (CURRENT naming a missing MANIFEST, a listed SST deleted), is a
    CacheCorruptError, which task sessions answer by discarding the cache and rebuilding it from the index; anything
    else (a full disk, too many open files) a CacheError."""
    text = str(exc)
    if text.startswith("Corruption") or _OWN_FILE_MISSING.match(text):  # the status code comes first, paths later
        return CacheCorruptError(
            f"{what} failed: {exc}; the cache's files are damaged (disk or copy error, or a "
            "file deleted by hand): delete its directory (a Spark task session does) and it is "
            "rebuilt from the index"
        )
    return CacheError(f"{what} failed: {exc}")


def _has_memtable_data(view: rd.Rdict) -> bool:
    """Whether a column family has writes that only live in memory (active or immutable memtables)."""
    active = view.property_int_value("rocksdb.num-entries-active-mem-table") or 0
    deletes = view.property_int_value("rocksdb.num-deletes-active-mem-table") or 0
    immutable = view.property_int_value("rocksdb.num-immutable-mem-table") or 0
    return bool(active or deletes or immutable)


def directory_bytes(path: Path) -> int:
    """Bytes of the files in a cache directory (RocksDB keeps it flat), tolerating files that vanish meanwhile:
    RocksDB deletes obsolete files concurrently (compaction, dropped families)."""
    total = 0
    for entry in os.scandir(path):
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total
