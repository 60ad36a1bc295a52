"""The key column of data files, kept per process, with a hash index for finding given keys' rows.

Why: every upsert must find, in each touched file group's older live files, the rows whose key the batch writes
again (they become deletion vectors: data/superseded.py). Data files are immutable, so a file's keys are read once per
process and kept (a bounded LRU); a scan of every older row per batch (`is_in`) grows with the table, so each file
also keeps its keys' 32-bit hashes sorted once: finding m keys in a file of n rows is then m binary searches
(O(m log n)), and every hash match is confirmed by comparing the key itself (collisions never make a false hit).

The hash is this module's own (`index_hashes`), not Spark's: nothing outside this index sees it, so it only has to be
a function of the key's bytes and cheap. Indexing the files a process did not write is what the first batch after a
large load pays (5 M keys per shard at 10 M rows): Spark's Murmur3 took 0.6 s of it and a stable argsort 0.75 s; this
hash takes ~0.2 s and the unstable sort 0.2 s (rows of one hash value need no order).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.table.records import DataFileRecord

KEY_CACHE_BYTES = int(os.environ.get("DBIDX_KEY_CACHE_MB", "512")) * 2 ** 20
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(31)
_FOLD = np.uint64(32)
_GATHER_BYTES = 1 << 24  # bytes gathered at once for keys of one length stored apart (bounds the index arrays)


def index_hashes(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 32-bit hash (uint32) of each key (strings, no nulls) for the index: a function of the key's UTF-8 bytes
    alone, the same whichever array holds the key (a probe and a file must agree).

    Per key of L bytes, zero-padded to 8-byte little-endian words w: h = L * M, then per word h = (h ^ w) * M,
    h ^= h >> 31 (mod 2**64), and the result is the low 32 bits of h ^ (h >> 32). Keys of one length are hashed
    together as the rows of a matrix of words (one numpy pass per word position), so UUIDs cost 4 passes.
    """
    keys = one_chunk(keys) if isinstance(keys, pa.ChunkedArray) else keys
    n = len(keys)
    off_type = np.int64 if pa.types.is_large_string(keys.type) else np.int32
    offsets = np.frombuffer(keys.buffers()[1], dtype=off_type, count=n + 1,
                            offset=keys.offset * np.dtype(off_type).itemsize).astype(np.int64)
    data = keys.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    out = np.empty(n, dtype=np.uint64)
    if n and lengths.min() == lengths.max():  # one length (UUIDs, fixed-width ids): the keys are back to back
        length = int(lengths[0])
        out[:] = _hash_rows(data[offsets[0]:offsets[0] + n * length].reshape(n, length))
    elif n:
        for length in np.unique(lengths).tolist():
            rows = np.flatnonzero(lengths == length)
            step = max(1, _GATHER_BYTES // max(length, 1))
            for lo in range(0, len(rows), step):
                part = rows[lo:lo + step]
                out[part] = _hash_rows(data[offsets[part][:, None] + np.arange(length)])
    out ^= out >> _FOLD
    return out.astype(np.uint32)


def _hash_rows(block: np.ndarray) -> np.ndarray:
    """index_hashes' 64-bit state for keys of one length, given as the rows of a uint8 matrix."""
    count, length = block.shape
    width = -(-length // 8) * 8
    if width != length or not block.flags.c_contiguous:
        padded = np.zeros((count, width), dtype=np.uint8)
        padded[:, :length] = block
        block = padded
    words = block.view("<u8")
    with np.errstate(over="ignore"):
        h = np.full(count, length, dtype=np.uint64)
        h *= _MULTIPLIER
        for w in range(width // 8):
            h ^= words[:, w]
            h *= _MULTIPLIER
            h ^= h >> _SHIFT
    return h


@dataclass(frozen=True)
class Probe:
    """Keys to look for in files, with their hashes computed once (for all the files probed)."""

    keys: pa.Array
    hashes: np.ndarray

    @classmethod
    def of(cls, keys: pa.Array) -> "Probe":
        """A probe for these keys (strings, no nulls), sorted by hash (binary searches of sorted needles touch
        memory in order: several times faster than in arrival order)."""
        hashes = index_hashes(keys)
        order = np.argsort(hashes)
        return cls(keys.take(pa.array(order)), hashes[order])


@dataclass(frozen=True)
class FileKeys:
    """One data file's keys in row order, and its rows ordered by key hash (the index `rows_of` searches)."""

    keys: pa.Array
    sorted_hashes: np.ndarray
    order: np.ndarray  # row of each sorted hash

    @classmethod
    def of(cls, keys: pa.Array) -> "FileKeys":
        """Index a file's keys (strings, no nulls, in row order)."""
        hashes = index_hashes(keys)
        order = np.argsort(hashes).astype(np.int32)  # a data file has far fewer than 2**31 rows
        return cls(keys, hashes[order], order)

    @property
    def nbytes(self) -> int:
        """Memory held (what the LRU budget counts)."""
        return self.keys.nbytes + self.sorted_hashes.nbytes + self.order.nbytes

    def rows_of(self, probe: Probe) -> np.ndarray:
        """Rows of this file (int32, in no particular order, a row twice if the probe has its key twice) whose key
        is one of the probe's keys."""
        # 1. Candidates: every row whose hash equals a probe key's hash (a run per probe key, usually empty).
        lo = np.searchsorted(self.sorted_hashes, probe.hashes, side="left")
        hi = np.searchsorted(self.sorted_hashes, probe.hashes, side="right")
        counts = hi - lo
        total = int(counts.sum())
        if total == 0:
            return np.empty(0, dtype=np.int32)
        which = np.repeat(np.arange(len(counts)), counts)  # the probe key of each candidate
        firsts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
        rows = self.order[firsts + np.arange(total)]
        # 2. Confirmed by the keys themselves: a hash collision is never a hit.
        same = pc.equal(self.keys.take(pa.array(rows)), probe.keys.take(pa.array(which)))
        return rows[same.to_numpy(zero_copy_only=False)]


class KeyColumns:
    """Per process: FileKeys of data files, by (path, checksum), least recently used dropped past a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], FileKeys] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def find(self, record: DataFileRecord) -> FileKeys | None:
        """The file's keys if this process holds them (marked recently used)."""
        ident = (record.path, record.checksum)
        with self._lock:
            found = self._items.get(ident)
            if found is not None:
                self._items.move_to_end(ident)
            return found

    def get(self, record: DataFileRecord, read: Callable[[DataFileRecord], pa.Array]) -> FileKeys:
        """The file's keys, read by `read(record)` (verified by the caller) on a miss and kept."""
        found = self.find(record)
        if found is not None:
            return found
        return self.put(record, read(record))

    def put(self, record: DataFileRecord, keys: pa.Array) -> FileKeys:
        """Keep a file's keys (strings in row order): what a writer just wrote or read; returns them indexed."""
        ident = (record.path, record.checksum)
        with self._lock:
            known = self._items.get(ident)
            if known is not None:
                return known
        indexed = FileKeys.of(keys)
        with self._lock:
            if ident not in self._items:
                self._items[ident] = indexed
                self._bytes += indexed.nbytes
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes
            return self._items.get(ident, indexed)


KEYS = KeyColumns(KEY_CACHE_BYTES)
