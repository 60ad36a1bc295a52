"""Loading: a shard's slice of the persisted index (its snapshot at a completion seq) into a cache partition.

The one loading path: `prepare_slice` reads only the shard's file groups of one partition (of the whole index in
global mode) and writes them as one SST, anywhere (a pool worker, a loader thread); `RecordIndexCache.
install_partition` ingests it, visible only once complete. Who calls it, and how many at once, is the only
difference between the loaders: bootstrap builds many in a pool (bootstrap/loader.py), an on-demand loader a
batch's cold partitions concurrently (bootstrap/on_demand.py), catch-up one reload at a time
(`load_from_snapshot`; cache/catchup.py decides when).
"""
from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.cache.codec import GLOBAL_SEPARATOR
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.sst_builder import PreparedLoad, build_sst
from dbidx.config import CacheConfig
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
    return one_chunk(entries.column(KEY)), one_chunk(locations)


def prepare_slice(table: Table, shard: int, partition: str, seq: int, global_mode: bool, sst_path: str,
                  config: CacheConfig) -> PreparedLoad:
    """Read one shard's slice of a partition from the index and write it as an SST at `sst_path` (picklable
    inputs: bootstrap runs it in worker processes)."""
    keys, locations = snapshot_entries(table, shard, partition, seq, global_mode)
    return build_sst(partition, keys, locations, sst_path, config)


def load_from_snapshot(cache: RecordIndexCache, table: Table, partition: str, as_of_seq: int) -> int:
    """(Re)load one partition of the cache's shard from the index snapshot at a completion seq, in this thread;
    returns its entries."""
    sst = cache.scratch_dir / f"load-{uuid.uuid4().hex[:12]}.sst"
    try:
        prepared = prepare_slice(table, cache.identity.shard, partition, as_of_seq, cache.global_mode, str(sst),
                                 cache.config)
        cache.install_partition(prepared, as_of_seq)
    except BaseException:
        sst.unlink(missing_ok=True)
        raise
    return prepared.entries
