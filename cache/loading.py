"""Loading: a shard's slice of the persisted index (its snapshot at a completion seq) into a cache partition.

What bootstrap, on-demand loading and catch-up's reloads share: read only the shard's file groups of one partition
(of the whole index in global mode) and hand the keys and their cache locations to `RecordIndexCache.load_partition`
(one SST, visible only once complete). Catch-up (cache/catchup.py) decides when to reload; this module only loads.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from dbidx.cache.codec import GLOBAL_SEPARATOR
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.mdt.rli_files import FILE_GROUP, KEY, PARTITION
from dbidx.mdt.table import Table


def snapshot_entries(table: Table, shard: int, partition: str, as_of_seq: int,
                     global_mode: bool) -> tuple[pa.Array, pa.Array]:
    """(keys, cache locations) of one shard's slice of a partition (global mode: of the whole index) at a seq.

    Reads only that shard's file group(s), never the whole partition. Picklable inputs: loaders call it in worker
    processes too.
    """
    return cache_entries(table.snapshot(None if global_mode else partition, shard=shard, as_of=as_of_seq),
                         global_mode)


def cache_entries(entries: pa.Table, global_mode: bool) -> tuple[pa.Array, pa.Array]:
    """(keys, cache locations) of live index entries: the file group, or in global mode "partition\\0file
    group" (codec.global_location, vectorised)."""
    if global_mode:
        locations = pc.binary_join_element_wise(entries.column(PARTITION), entries.column(FILE_GROUP),
                                                GLOBAL_SEPARATOR)
    else:
        locations = entries.column(FILE_GROUP)
    return _single_chunk(entries.column(KEY)), _single_chunk(locations)


def _single_chunk(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def load_from_snapshot(cache: RecordIndexCache, table: Table, partition: str, as_of_seq: int) -> int:
    """(Re)load one partition of the cache's shard from the MDT snapshot at a completion seq; returns entries."""
    keys, locations = snapshot_entries(table, cache.identity.shard, partition, as_of_seq, cache.global_mode)
    cache.load_partition(partition, keys, locations, synced_seq=as_of_seq)
    return len(keys)
