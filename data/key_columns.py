"""The key column of data files, kept per process, with a hash index for finding given keys' rows.

Why: every upsert must find, in each touched file group's older live files, the rows whose key the batch writes
again (they become deletion vectors: data/superseded.py). Data files are immutable, so a file's keys are read once per
process and kept (a bounded LRU); a scan of every older row per batch (`is_in`) grows with the table, so each file
also keeps its keys' 32-bit hashes sorted once: finding m keys in a file of n rows is then m binary searches
(O(m log n)), and every hash match is confirmed by comparing the key itself (collisions never make a false hit).

Indexing the files a process did not write is what the first batch a worker runs after a large load pays (5 M keys
per shard at 10 M rows): the sort is numpy's unstable one (0.2 s for 5 M hashes, against 0.75 s for a stable sort:
rows of one hash value need no order), and the hash Spark's (storage/keyhash.py, ~0.35 s for 5 M UUIDs).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Protocol

import numpy as np
import pyarrow as pa

from dbidx.lru import BytesLRU
from dbidx.storage.keyhash import spark_hash
from dbidx.storage.records import DataFileRecord

KEY_CACHE_BYTES = int(os.environ.get("DBIDX_KEY_CACHE_MB", "512")) * 2**20


@dataclass(frozen=True)
class Probe:
    """Keys to look for in files, with their hashes computed once (for all the files probed)."""

    keys: pa.Array
    hashes: np.ndarray

    @classmethod
    def of(cls, keys: pa.Array) -> "Probe":
        """A probe for these keys (strings, no nulls), sorted by hash (binary searches of sorted needles touch
        memory in order: several times faster than in arrival order)."""
        hashes = spark_hash(keys).view(np.uint32)
        order = np.argsort(hashes)
        return cls(keys.take(pa.array(order)), hashes[order])

    @classmethod
    def of_files(cls, files: list["FileKeys"]) -> "Probe":
        """A probe for the keys of indexed files (a writer's new files): their hashes are computed already, and
        each file's are sorted, so one file needs no sort at all and several need one over the merged runs."""
        keys = pa.concat_arrays([f.keys.take(pa.array(f.order)) for f in files])
        hashes = np.concatenate([f.sorted_hashes for f in files])
        if len(files) > 1:
            order = np.argsort(hashes, kind="stable")  # timsort: linear on a few sorted runs
            keys, hashes = keys.take(pa.array(order)), hashes[order]
        return cls(keys, hashes)


@dataclass(frozen=True)
class FileKeys:
    """One data file's keys in row order, and its rows ordered by key hash (the index `hash_matches` searches)."""

    keys: pa.Array
    sorted_hashes: np.ndarray
    order: np.ndarray  # row of each sorted hash

    @classmethod
    def of(cls, keys: pa.Array) -> "FileKeys":
        """Index a file's keys (strings, no nulls, in row order)."""
        hashes = spark_hash(keys).view(np.uint32)
        order = np.argsort(hashes).astype(np.int32)  # a data file has far fewer than 2**31 rows
        return cls(keys, hashes[order], order)

    @cached_property
    def nbytes(self) -> int:
        """Memory held (what the LRU budget counts). Cached: Arrow sums a sliced string array's buffers anew on each
        call (~0.15 ms), and the LRU and the key files ask once per file kept."""
        return self.keys.nbytes + self.sorted_hashes.nbytes + self.order.nbytes


def hash_matches(sorted_hashes: np.ndarray, probe: Probe) -> tuple[np.ndarray, np.ndarray]:
    """Every entry of `sorted_hashes` whose hash equals a probe key's hash, and the probe key of each (both int
    arrays of the same length): the candidates a key comparison then confirms.

    A run of entries per probe key, usually empty: one search finds where each run would start; only the probe keys
    whose hash is there (few: most keys of a batch are in none of a group's older files) are searched again for
    where their run ends."""
    if not len(sorted_hashes) or not len(probe.hashes):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    lo = np.searchsorted(sorted_hashes, probe.hashes, side="left")
    which_keys = np.flatnonzero(sorted_hashes[np.minimum(lo, len(sorted_hashes) - 1)] == probe.hashes)
    if not len(which_keys):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    lo = lo[which_keys]
    counts = np.searchsorted(sorted_hashes, probe.hashes[which_keys], side="right") - lo
    which = np.repeat(which_keys, counts)
    entries = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return entries, which


@dataclass
class KeySources:
    """Where the key indexes of a search came from: this process, the executor's key files, or the data files."""

    memory: int = 0
    key_files: int = 0
    data_files: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, source: str, n: int = 1) -> None:
        """Add n to one source's count (safe from the reader threads of a search)."""
        with self._lock:
            setattr(self, source, getattr(self, source) + n)


class KeyColumns:
    """Per process: FileKeys of data files, by (path, checksum), least recently used dropped past a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self._kept: BytesLRU[tuple[str, str], FileKeys] = BytesLRU(max_bytes)

    def find(self, record: DataFileRecord) -> FileKeys | None:
        """The file's keys if this process holds them (marked recently used)."""
        return self._kept.get((record.path, record.checksum))

    def get(
        self,
        record: DataFileRecord,
        read: Callable[[DataFileRecord], pa.Array],
        disk: KeyStore | None = None,
        sources: KeySources | None = None,
    ) -> FileKeys:
        """The file's keys: from this process, else from `disk` (another process built them), else read by
        `read(record)` (verified by the caller), indexed and kept (on `disk` too); `sources` counts which."""
        sources = sources if sources is not None else KeySources()
        found = self.find(record)
        if found is not None:
            sources.count("memory")
            if disk is not None:
                disk.touch(record)  # used: its key file is not the one a trim drops first
            return found
        loaded = disk.load(record) if disk is not None else None
        if loaded is not None:
            sources.count("key_files")
            return self._keep(record, loaded)
        sources.count("data_files")
        return self.put(record, read(record), disk)

    def put(self, record: DataFileRecord, keys: pa.Array, disk: KeyStore | None = None) -> FileKeys:
        """Keep a file's keys (strings in row order): what a writer just wrote or read; returns them indexed."""
        known = self.find(record)
        if known is not None:
            return known
        indexed = FileKeys.of(keys)
        if disk is not None:
            disk.save(record, indexed)
        return self._keep(record, indexed)

    def _keep(self, record: DataFileRecord, indexed: FileKeys) -> FileKeys:
        return self._kept.put((record.path, record.checksum), indexed, indexed.nbytes)


class KeyStore(Protocol):
    """A second tier of FileKeys shared beyond this process (data/key_files.KeyFiles): never required."""

    def load(self, record: DataFileRecord) -> FileKeys | None: ...

    def save(self, record: DataFileRecord, keys: FileKeys) -> None: ...

    def touch(self, record: DataFileRecord) -> None: ...


KEYS = KeyColumns(KEY_CACHE_BYTES)
