"""Reading a dbidx table with Spark: the current rows, planned per file group so that no shuffle is needed.

`read_table` hands each task whole file groups (a record lives in one) balanced by bytes; each task merges them with
data/reads.py. `committed_data_files` / `committed_data_records` list what completed upserts published.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable, Iterator, Sequence

import pyarrow as pa

from dbidx.data import reads
from dbidx.table.facade import Table
from dbidx.storage.records import ACTION_COMMIT, DataFileRecord

__all__ = ["read_table"]


def committed_data_files(table: Table) -> list[tuple[str, int, str]]:
    """(path, completion seq, instant) of every data file a completed upsert published, oldest first."""
    return [(f.path, seq, instant) for f, seq, instant in committed_data_records(table)]


def committed_data_records(table: Table) -> list[tuple[DataFileRecord, int, str]]:
    """(record, completion seq, instant) of every data file a completed upsert published, oldest first."""
    table.refresh()
    return [
        (f, rec.seq, rec.instant)
        for rec in table.timeline.kept()  # those after a history floor
        if rec.action == ACTION_COMMIT
        for f in rec.data_files
    ]


def _read_unit_groups(
    ids: Iterator[pa.RecordBatch], table: Table, groups: list[list[reads.ReadUnit]], key: str, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of `read_table`: the live rows of this task's file groups (reads.read_unit)."""
    for batch in ids:
        for task_id in batch.column(0).to_pylist():
            yield from reads.read_units(table.io, groups[task_id], key, schema, table)


def _balanced(units: Sequence[reads.ReadUnit], tasks: int) -> list[list[reads.ReadUnit]]:
    """Units spread over at most `tasks` groups of about equal bytes (largest first, each to the lightest group)."""
    groups: list[list[reads.ReadUnit]] = [[] for _ in range(max(1, min(tasks, len(units))))]
    loads = [0] * len(groups)
    for unit in sorted(units, key=lambda u: u.bytes, reverse=True):
        lightest = loads.index(min(loads))
        groups[lightest].append(unit)
        loads[lightest] += unit.bytes
    return groups


def read_table(
    spark: Any,
    table: Table,
    partitions: Iterable[str] | None = None,
    columns: Sequence[str] | None = None,
    with_meta: bool = False,
    as_of: int | str | None = None,
    version: int | None = None,
) -> Any:
    """The table's current rows as a DataFrame: per record the version of the latest commit, deletes dropped.

    Planned per file group (a record lives in one), so the read needs no shuffle: each task merges whole file
    groups (data/reads.py). partitions: partition paths to read (e.g. ["dt=2025-01-15"]); columns: the data
    columns to return; with_meta adds `_dbidx_file_group` and `_dbidx_instant`; as_of (a completion seq or instant
    id) or version (a Delta version: `_delta_log/`'s numbering) reads that older version. An empty table reads as an
    empty DataFrame with the table's schema. Files are read through the table's FileIO (any pyarrow filesystem, S3
    included) and verified against their recorded size and checksum: a damaged file fails the read with
    CorruptFileError naming it, never a silently smaller table.
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    plan = reads.plan_read(table, partitions, as_of, version)
    schema = reads.output_schema(plan, columns, with_meta)
    spark_schema = from_arrow_schema(schema)
    if plan.key is None or not plan.units:
        return spark.createDataFrame([], spark_schema)
    # 1. File groups balanced by bytes over a few tasks per core; each task gets its groups' ids.
    groups = _balanced(plan.units, spark.sparkContext.defaultParallelism * 2)
    ids = spark.range(0, len(groups), numPartitions=len(groups)).selectExpr("cast(id as int) as id")
    # 2. Each task reads and merges its file groups: no shuffle.
    return ids.mapInArrow(
        partial(_read_unit_groups, table=table, groups=groups, key=plan.key, schema=schema), spark_schema
    )
