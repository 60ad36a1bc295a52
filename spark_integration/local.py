"""`upsert_arrow`: the upsert of `api.upsert` for an Arrow table, run in this process without Spark.

The same task code (`task.upsert_batches`: dedupe, tag against the shard caches, write data and index files) runs
for each shard one after another, and the same publish step checks and commits the results. For tests, tools and
small batches where a Spark session is not worth its start-up; a Spark pipeline uses `api.upsert`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.progress import Progress, Steps
from dbidx.spark_integration import task
from dbidx.spark_integration.bulk import empty_table_seq
from dbidx.spark_integration.driver import CommitSummary, make_options, run_upsert
from dbidx.spark_integration.tagger import ROW_ID
from dbidx.storage.keys import unfit_key_kind

__all__ = ["upsert_arrow"]


def upsert_arrow(
    data: pa.Table,
    table: Table,
    *,
    key: str,
    partition: str,
    ordering: str | None = None,
    delete_column: str | None = "_dbidx_delete",
    hive_style: bool = True,
    buckets: BucketSpec | None = None,
    cache_options: Mapping[str, Any] | None = None,
    cache_config: CacheConfig | None = None,
    progress: Progress | None = None,
) -> CommitSummary:
    """Insert, update and delete the rows of an Arrow table as one atomic instant (semantics of `api.upsert`,
    including its required `key` and `partition` keywords). `progress` (dbidx.progress) hears of each shard task
    as it finishes here (rows: input rows so far)."""
    options = make_options(
        table, key, partition, ordering, delete_column, hive_style, buckets, cache_options, cache_config
    )
    options.check_columns(
        data.column_names,
        "the upsert table",
        {f.name: pa.types.is_boolean(f.type) for f in data.schema},
        {f.name: (str(f.type), kind) if (kind := unfit_key_kind(f.type)) else None for f in data.schema},
    )
    options = replace(options, bulk_seq=empty_table_seq(table))  # a first write takes the bulk path
    # Partition values the table's layout cannot hold (empty hive values, paths outside its recorded partition
    # columns) are refused here, before the instant starts: such a batch leaves no completion behind.
    options.check_layout_values(data)
    schema = data.schema
    data = data.append_column(ROW_ID, pa.array(np.arange(data.num_rows, dtype=np.int64)))
    shards = table.shard_of(options.keys_of(data)) if data.num_rows else np.zeros(0, dtype=np.int64)

    def job(instant: str) -> list[tuple[int, int, bytes]]:
        results = []
        steps = Steps(progress, table.num_shards)
        for shard in range(table.num_shards):
            rows = data.filter(pa.array(shards == shard)) if data.num_rows else data
            result = task.upsert_batches(rows.to_batches(), table, options, instant, attempt=shard)
            results.append((shard, shard, result.pack()))
            steps.step(f"shard {shard} tagged and written", rows.num_rows)
        return results

    return run_upsert(table, options, job, schema, "the upsert table")
