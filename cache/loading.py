"""Loading: a shard's slice of the persisted index (its snapshot at a completion seq) into a cache partition.

The one loading path: read only the shard's file groups of one partition (of the whole index in global mode), write
them as one SST (`sst_builder.build_sst`), and let `RecordIndexCache.install_partition` ingest it, visible only once
complete. `load_from_snapshot` does it in the calling thread (through `RecordIndexCache.load_partition`): catch-up's
reloads (cache/catchup.py decides when) and an on-demand loader's threads (bootstrap/on_demand.py) call it;
`prepare_slice` builds the SST alone, for bootstrap's pool of workers, whose owner installs the results
(bootstrap/loader.py).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.cache.codec import GLOBAL_SEPARATOR
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.sst_builder import PreparedLoad, build_sst
from dbidx.config import CacheConfig
from dbidx.index.rli_files import FILE_GROUP, KEY, PARTITION
from dbidx.table.facade import Table


def snapshot_entries(
    table: Table, shard: int, partition: str, as_of_seq: int, global_mode: bool
) -> tuple[pa.Array, pa.Array]:
    """(keys, cache locations) of one shard's slice of a partition (global mode: of the whole index) at a seq.

    Reads only that shard's file group(s), never the whole partition. Picklable inputs: loaders call it in worker
    processes too.
    """
    return cache_entries(table.snapshot(None if global_mode else partition, shard=shard, as_of=as_of_seq), global_mode)


def cache_entries(entries: pa.Table, global_mode: bool) -> tuple[pa.Array, pa.Array]:
    """(keys, cache locations) of live index entries: the file group, or in global mode "partition\\0file
    group" (codec.global_location, vectorised)."""
    if global_mode:
        locations = pc.binary_join_element_wise(entries.column(PARTITION), entries.column(FILE_GROUP), GLOBAL_SEPARATOR)
    else:
        locations = entries.column(FILE_GROUP)
    return one_chunk(entries.column(KEY)), one_chunk(locations)


def prepare_slice(
    table: Table, shard: int, partition: str, seq: int, global_mode: bool, sst_path: str, config: CacheConfig
) -> PreparedLoad:
    """Read one shard's slice of a partition from the index and write it as an SST at `sst_path` (picklable
    inputs: bootstrap runs it in worker processes)."""
    keys, locations = snapshot_entries(table, shard, partition, seq, global_mode)
    return build_sst(partition, keys, locations, sst_path, config)


def load_from_snapshot(cache: RecordIndexCache, table: Table, partition: str, as_of_seq: int) -> int:
    """(Re)load one partition of the cache's shard from the index snapshot at a completion seq, in this thread;
    returns its entries."""
    keys, locations = snapshot_entries(table, cache.shard, partition, as_of_seq, cache.global_mode)
    return cache.load_partition(partition, keys, locations, synced_seq=as_of_seq).entries
