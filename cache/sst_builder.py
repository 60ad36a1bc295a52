"""Build one partition's SST file from Arrow arrays, without touching an open cache.

Why apart from the cache: building (encode keys, sort, write the SST) is the CPU-heavy half of a load and needs no
RocksDB handle, so it can run in another process (RocksDB allows one opener per directory, and opening a DB before
a fork hangs the child); the process that owns the cache only ingests the finished file (cheap, a file move).
The location dictionary is written into the same SST under LOCATIONS_KEY (0xFF sorts after every encoded key), so
data and dictionary arrive in one atomic ingest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import rocksdict as rd

from dbidx.cache import codec, registry
from dbidx.cache.store import column_family_options
from dbidx.config import CacheConfig
from dbidx.errors import InvalidInputError, InvalidKeyError

# The location dictionary of a partition lives inside its own column family under this key (no encoded record key
# starts with 0xFF), so it is always flushed and ingested together with the values that reference it.
LOCATIONS_KEY = b"\xff"


@dataclass
class PreparedLoad:
    """A partition's content as a finished SST file, ready to ingest (picklable: crosses process boundaries)."""

    partition: str
    sst_path: str | None  # None: the partition has no entries in this shard
    locations: list[str]
    fills: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    seconds: float = 0.0


def _as_string_array(values: Any, what: str) -> pa.Array:
    """codec.as_string_array, then refuse non-string types and nulls, naming what was passed."""
    values = codec.as_string_array(values)
    if not pa.types.is_string(values.type):
        raise InvalidInputError(f"{what} must be strings, got Arrow type {values.type}")
    if values.null_count:
        raise (InvalidKeyError if what == "keys" else InvalidInputError)(f"{what} contain {values.null_count} null(s)")
    return values


def build_sst(partition: str, keys: Any, locations: Any, sst_path: str | Path, config: CacheConfig) -> PreparedLoad:
    """Write the live entries (key -> location) of one partition slice into a sorted SST file."""
    started = time.perf_counter()
    key_array = _as_string_array(keys, "keys")
    loc_array = _as_string_array(locations, "locations")
    if len(key_array) != len(loc_array):
        raise InvalidInputError(f"{len(key_array)} keys but {len(loc_array)} locations for partition {partition!r}")
    if len(key_array) == 0:
        return PreparedLoad(partition, None, [], {}, 0, time.perf_counter() - started)
    # 1. Location dictionary and per-location fills, vectorised (file group ids repeat a lot).
    encoded_locs = loc_array.dictionary_encode()
    dictionary: list[str] = encoded_locs.dictionary.to_pylist()
    indices = encoded_locs.indices.to_numpy(zero_copy_only=False)
    counts = np.bincount(indices, minlength=len(dictionary))
    fills = {loc: int(n) for loc, n in zip(dictionary, counts) if n}
    value_of = [codec.encode_index(i) for i in range(len(dictionary))]
    # 2. Encode the keys and sort them bytewise (Arrow compares binary values with memcmp, like RocksDB). Keys
    #    that arrive sorted (an index file's entries: sorted strings of canonical UUIDs or of raw keys encode in
    #    the same order) are checked to be strictly ascending in one pass and not sorted again.
    binary = codec.encode_keys_binary(key_array)
    ascending = len(binary) > 1 and pc.all(pc.less(binary.slice(0, len(binary) - 1), binary.slice(1))).as_py()
    if ascending:
        order, ordered = None, binary
    else:
        order = pc.sort_indices(binary).to_numpy()
        ordered = binary.take(order)
    # 3. A key twice in one load would silently keep one location: refuse it, naming the key (strictly ascending
    #    keys hold no repeat).
    if len(ordered) > 1 and not ascending:
        same = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))
        if pc.any(same).as_py():
            first = int(np.argmax(same.to_numpy(zero_copy_only=False)))
            duplicate = codec.decode_key(ordered[first].as_py())
            raise InvalidInputError(f"key {duplicate!r} appears twice in the load of partition {partition!r}")
    # 4. Write in key order, the dictionary last (0xFF sorts after every encoded key). One location (a bulk load's
    #    partition slice, mostly) is one value for every key: ~25 % less per put than looking each one up.
    writer = rd.SstFileWriter(sst_options(config))
    writer.open(str(sst_path))
    if len(dictionary) == 1:
        only = value_of[0]
        for key in ordered.to_pylist():
            writer[key] = only
    else:
        for key, idx in zip(ordered.to_pylist(), (indices if ascending else indices[order]).tolist()):
            writer[key] = value_of[idx]
    writer[LOCATIONS_KEY] = registry.pack(dictionary)
    writer.finish()
    return PreparedLoad(partition, str(sst_path), dictionary, fills, len(binary), time.perf_counter() - started)


_OPTIONS: dict[CacheConfig, rd.Options] = {}


def sst_options(config: CacheConfig) -> rd.Options:
    """SST writer options matching the cache's column families (compression, block size, bloom filter)."""
    opts = _OPTIONS.get(config)
    if opts is None:
        opts = _OPTIONS[config] = column_family_options(config, None)
    return opts


def build_changes_sst(
    sst_path: str | Path,
    keys: list[bytes],
    values: list[bytes],
    deleted: list[bool],
    dictionary: list[str] | None,
    config: CacheConfig,
) -> None:
    """Write a column family's changes (sorted distinct encoded keys: a value, or a tombstone where `deleted`) into
    one SST to ingest over what the family holds: a large catch-up skips the memtable and its flush.

    `dictionary`: the family's whole location dictionary when the changes extended it, written under LOCATIONS_KEY
    so the values and the dictionary they reference arrive in one ingest.
    """
    writer = rd.SstFileWriter(sst_options(config))
    writer.open(str(sst_path))
    for key, value, gone in zip(keys, values, deleted):
        if gone:
            del writer[key]
        else:
            writer[key] = value
    if dictionary is not None:
        writer[LOCATIONS_KEY] = registry.pack(dictionary)
    writer.finish()
