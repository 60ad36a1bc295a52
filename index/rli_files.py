"""RLI files: sorted Parquet files of index entries, and the pure Arrow logic that merges them.

A file holds rows (key, [partition,] file_group, instant, deleted) sorted by key, zstd-compressed, with min/max
statistics per row group. Sorting makes row-group statistics exact key ranges, which is what point lookups seek on.
Merging is "newest entry per key wins, tombstones hide the key", applied in completion order.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.arrays import one_chunk, string_sort_indices
from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import DECODE_ERRORS, FileIO, file_checksum
from dbidx.storage.records import FileRecord

KEY = "key"
PARTITION = "partition"
FILE_GROUP = "file_group"
INSTANT = "instant"
DELETED = "deleted"

PARTITIONED_SCHEMA = pa.schema(
    [(KEY, pa.string(), False), (FILE_GROUP, pa.string()), (INSTANT, pa.string(), False), (DELETED, pa.bool_(), False)]
)
GLOBAL_SCHEMA = pa.schema(
    [
        (KEY, pa.string(), False),
        (PARTITION, pa.string()),
        (FILE_GROUP, pa.string()),
        (INSTANT, pa.string(), False),
        (DELETED, pa.bool_(), False),
    ]
)
_ORD = "__ord"

# Default chosen by benchmarks/index_bench.py: the fraction of a file's row groups a lookup must touch above which
# one sequential read of the key column beats reading the touched row groups one by one.
DEFAULT_SEEK_THRESHOLD = 0.25


def schema_for(global_mode: bool) -> pa.Schema:
    """The entry schema of a table's RLI files."""
    return GLOBAL_SCHEMA if global_mode else PARTITIONED_SCHEMA


def sort_entries(table: pa.Table) -> pa.Table:
    """Entries sorted by key (the order every RLI file is written in; the commit writer checks it before writing)."""
    return table.take(pa.array(string_sort_indices(table.column(KEY))))


def write_rli_file(
    io: FileIO,
    rel: str,
    table: pa.Table,
    row_group_size: int,
    partition: str | None = None,
    shard: int = 0,
    kind: str = "delta",
) -> FileRecord:
    """Write sorted entries as one Parquet file under `rel`; returns its record with size and checksum.

    The file is serialized in memory first, so the checksum covers exactly the bytes written (no read-back).
    """
    dict_cols = [c for c in (PARTITION, FILE_GROUP, INSTANT) if c in table.column_names]
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        row_group_size=row_group_size,
        compression="zstd",
        compression_level=3,
        use_dictionary=dict_cols,
        write_statistics=[KEY],
        sorting_columns=[pq.SortingColumn(0)],
    )
    data = sink.getvalue()
    io.write_atomic(rel, data)
    tombstones = int(pc.sum(table.column(DELETED)).as_py() or 0)
    keys = table.column(KEY)
    return FileRecord(
        path=rel,
        partition=partition,
        shard=shard,
        kind=kind,
        rows=table.num_rows,
        inserts=table.num_rows - tombstones,
        tombstones=tombstones,
        min_key=keys[0].as_py() if table.num_rows else None,
        max_key=keys[-1].as_py() if table.num_rows else None,
        size=data.size,
        checksum=file_checksum(data),
    )


def open_rli_file(io: FileIO, record: FileRecord) -> pq.ParquetFile:
    """Open an RLI file after checking its bytes against its commit record; any mismatch names the file."""
    where = io.path(record.path)
    data = io.read_verified(record.path, record.size, record.checksum, "RLI file")
    try:
        handle = pq.ParquetFile(pa.BufferReader(data))
    except DECODE_ERRORS as exc:
        raise CorruptFileError(f"RLI file {where} is unreadable (truncated or corrupt?): {exc}") from exc
    if handle.metadata.num_rows != record.rows:
        raise CorruptFileError(
            f"RLI file {where} holds {handle.metadata.num_rows} rows but its commit recorded {record.rows}"
        )
    expected = GLOBAL_SCHEMA if record.partition is None else PARTITIONED_SCHEMA
    if not handle.schema_arrow.remove_metadata().equals(expected):
        raise CorruptFileError(f"RLI file {where} has columns {handle.schema_arrow} instead of {expected}")
    return handle


def read_rli_file(io: FileIO, record: FileRecord, columns: list[str] | None = None) -> pa.Table:
    """All entries of one RLI file (verified against the commit record)."""
    handle = open_rli_file(io, record)
    try:
        return handle.read(columns=columns)
    except DECODE_ERRORS as exc:
        raise CorruptFileError(f"RLI file {io.path(record.path)} is corrupt: {exc}") from exc


def touched_row_groups(handle: pq.ParquetFile, sorted_keys: list[str]) -> list[int]:
    """Row groups whose [min, max] key range contains at least one of the (sorted) lookup keys."""
    meta = handle.metadata
    key_col = 0
    mins: list[str] = []
    maxs: list[str] = []
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(key_col).statistics
        if stats is None or not stats.has_min_max:
            return list(range(meta.num_row_groups))  # no statistics: every row group may match
        mins.append(stats.min)
        maxs.append(stats.max)
    touched = []
    for i in range(meta.num_row_groups):
        j = bisect.bisect_left(sorted_keys, mins[i])
        if j < len(sorted_keys) and sorted_keys[j] <= maxs[i]:
            touched.append(i)
    return touched


def read_matching(
    io: FileIO, record: FileRecord, sorted_keys: list[str], key_set: pa.Array, mode: str, threshold: float
) -> tuple[pa.Table, str]:
    """Entries of one file whose key is in `key_set`, by seeking touched row groups or scanning; returns (rows, how)."""
    if (
        record.min_key is not None
        and record.max_key is not None
        and (sorted_keys[-1] < record.min_key or sorted_keys[0] > record.max_key)
    ):
        return schema_empty(io, record), "skipped"
    handle = open_rli_file(io, record)
    how = mode
    try:
        if mode == "scan":
            table = handle.read()
        else:
            groups = touched_row_groups(handle, sorted_keys)
            total = max(handle.metadata.num_row_groups, 1)
            if mode == "auto" and len(groups) / total > threshold:
                how, table = "scan", handle.read()
            else:
                how, table = "seek", handle.read_row_groups(groups) if groups else handle.schema_arrow.empty_table()
    except DECODE_ERRORS as exc:
        raise CorruptFileError(f"RLI file {io.path(record.path)} is corrupt: {exc}") from exc
    return table.filter(pc.is_in(table.column(KEY), value_set=key_set)), how


def schema_empty(io: FileIO, record: FileRecord) -> pa.Table:
    """An empty table with the file's schema, without touching the file (global files carry a partition column)."""
    return (PARTITIONED_SCHEMA if record.partition is not None else GLOBAL_SCHEMA).empty_table()


def resolve_latest(tables: list[pa.Table], schema: pa.Schema, keep_tombstones: bool = False) -> pa.Table:
    """Merge entry tables given oldest first: the newest entry of each key wins; tombstoned keys disappear.

    Why this way: sorting once by (key, age) and keeping the first row of each key run is vectorized end to end,
    and a key that appears once (the common case, since locations are immutable) costs no Python work.
    """
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return schema.empty_table()
    if len(tables) == 1:
        only = tables[0]
        if keep_tombstones or not pc.any(only.column(DELETED)).as_py():
            return only
        return only.filter(pc.invert(only.column(DELETED)))
    # 1. Tag each row with the age of its file (higher = newer) and stack them.
    stacked = pa.concat_tables(
        [t.append_column(_ORD, pa.array(np.full(t.num_rows, i, dtype=np.int32))) for i, t in enumerate(tables)],
        promote_options="permissive",
    )
    # 2. Sort by key, newest first within a key.
    stacked = stacked.take(pc.sort_indices(stacked, sort_keys=[(KEY, "ascending"), (_ORD, "descending")]))
    # 3. Keep the first row of each run of equal keys.
    keys = one_chunk(stacked.column(KEY))
    first = np.ones(len(keys), dtype=bool)
    if len(keys) > 1:
        first[1:] = pc.not_equal(keys[1:], keys[:-1]).to_numpy(zero_copy_only=False)
    mask = pa.array(first)
    if not keep_tombstones:
        mask = pc.and_(mask, pc.invert(stacked.column(DELETED)))
    return stacked.filter(mask).drop_columns([_ORD])
