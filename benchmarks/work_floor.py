"""The work floor of an upsert batch: the same Spark job shape doing only the work no upsert can avoid.

Why a second anchor beside the Spark floor (an empty `mapInArrow` job): an upsert must look every key up and write
its rows, so the empty job is not a limit it can reach. The work floor does that much and nothing else, with every
advantage an upsert could hope for:
  1. Built once, untimed (`build`): per key shard, a RocksDB holding the table's keys (key -> 16 bytes), bulk
     loaded from one sorted SST, with a 10-bit bloom filter and a 256 MiB block cache per Python worker.
  2. Each run (`run`): the batch repartitioned by key into the shards, as an upsert does; each task multi-gets its
     keys, sorted, in its shard's RocksDB, kept open (read-only) in the Python worker across tasks and runs, so no
     task pays an open, a catch-up or a cold block cache; then writes its rows as one zstd Parquet file per
     partition value it touched. The driver writes and fsyncs one commit file listing the files.
  3. `warm` runs it once untimed first, so every worker has the DBs open and the blocks cached.
No deletion vectors, no index files, no conflict checks, no log: what it leaves out is what the ratio prices.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

KEY, PARTITION = "id", "dt"
VALUE = b"\x00" * 16  # an index value of a plausible size (file id + row position)
BLOCK_CACHE_MB = 256
HOLDER = "_dbidx_bench_work_floor"  # a module in each worker's sys.modules: state that outlives one task


def _options(block_cache: Any = None) -> Any:
    """Options for the floor's RocksDBs (raw bytes, bloom filter, the worker's block cache)."""
    import rocksdict as rd

    opts = rd.Options(raw_mode=True)
    opts.create_if_missing(True)
    table = rd.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    if block_cache is not None:
        table.set_block_cache(block_cache)
    opts.set_block_based_table_factory(table)
    return opts


class WorkFloor:
    """The work floor's RocksDBs (one per shard, under root) and its output directory."""

    def __init__(self, root: Path, shards: int) -> None:
        from pyspark import cloudpickle

        # The nested task functions use this module's helpers; workers cannot import it, so ship it by value.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self.root, self.shards = root, shards
        self.dbs, self.out = root / "dbs", root / "out"
        self.runs = 0

    def build(self, load: Any) -> float:
        """Untimed: one RocksDB per shard holding the keys of the load that land in it. Returns seconds taken."""
        from pyspark.sql import functions as F

        dbs = str(self.dbs)
        options = _options

        def build_shard(batches: Any) -> Any:  # nested: shipped by value (workers cannot import this script)
            import pyarrow as pa
            import pyarrow.compute as pc
            import rocksdict as rd
            from pyspark import TaskContext

            shard = TaskContext.get().partitionId()
            chunks = [b.column(0) for b in batches]
            keys = pa.chunked_array(chunks, pa.string()).combine_chunks() if chunks else pa.array([], pa.string())
            keys = pc.take(keys, pc.sort_indices(keys)).cast(pa.binary()).to_pylist()
            path = Path(dbs) / f"shard-{shard}"
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            sst = str(path.parent / f"shard-{shard}.sst")
            writer = rd.SstFileWriter(options())
            writer.open(sst)
            for key in keys:
                writer[key] = VALUE
            writer.finish()
            db = rd.Rdict(str(path), options())
            db.ingest_external_file([sst])
            db.close()
            os.remove(sst)
            yield pa.RecordBatch.from_pydict({"n": [len(keys)]})

        start = time.perf_counter()
        shutil.rmtree(self.root, ignore_errors=True)
        self.dbs.mkdir(parents=True)
        (
            load.select(F.col(KEY).cast("string").alias(KEY))
            .repartition(self.shards, F.col(KEY))
            .mapInArrow(build_shard, "n long")
            .collect()
        )
        return time.perf_counter() - start

    def run(self, df: Any) -> list[str]:
        """One work-floor job over df (a batch); returns the files it wrote (listed in its commit file)."""
        from pyspark.sql import functions as F

        dbs, out, holder_name, cache_mb, options = str(self.dbs), str(self.out), HOLDER, BLOCK_CACHE_MB, _options

        def lookup_and_write(batches: Any) -> Any:  # nested: shipped by value
            import sys
            import types
            import uuid

            import pyarrow as pa
            import pyarrow.compute as pc
            import pyarrow.parquet as pq
            import rocksdict as rd
            from pyspark import TaskContext

            # 1. The shard's RocksDB, open in this worker since an earlier task (opened read-only on first use).
            holder = sys.modules.get(holder_name)
            if holder is None:
                holder = sys.modules[holder_name] = types.ModuleType(holder_name)
                holder.dbs, holder.cache = {}, rd.Cache(cache_mb << 20)
            shard = TaskContext.get().partitionId()
            path = f"{dbs}/shard-{shard}"
            db = holder.dbs.get(path)
            if db is None:
                db = holder.dbs[path] = rd.Rdict(path, options(holder.cache), access_type=rd.AccessType.read_only())
            table = pa.Table.from_batches(list(batches))
            if table.num_rows == 0:
                yield pa.RecordBatch.from_pydict({"path": pa.array([], pa.string()), "found": pa.array([], pa.int64())})
                return
            # 2. Multi-get the task's keys, sorted.
            keys = table.column(KEY).combine_chunks()
            keys = pc.take(keys, pc.sort_indices(keys)).cast(pa.binary()).to_pylist()
            found = sum(value is not None for value in db[keys])
            # 3. One zstd Parquet file per partition value touched.
            table = table.sort_by(PARTITION)
            counts = pc.value_counts(table.column(PARTITION).combine_chunks())
            paths, offset = [], 0
            for entry in counts.to_pylist():
                value, count = entry["values"], entry["counts"]
                target = f"{out}/{PARTITION}={value}/part-{shard}-{uuid.uuid4().hex}.zstd.parquet"
                os.makedirs(os.path.dirname(target), exist_ok=True)
                pq.write_table(table.slice(offset, count), target, compression="zstd")
                paths.append(target)
                offset += count
            yield pa.RecordBatch.from_pydict({"path": paths, "found": [found] * len(paths)})

        files = [
            row["path"]
            for row in (
                df.repartition(self.shards, F.col(KEY).cast("string"))
                .mapInArrow(lookup_and_write, "path string, found long")
                .collect()
            )
        ]
        # 4. The driver's commit: one file listing the data files, written and fsynced.
        self.runs += 1
        commit = self.out / "_commits" / f"{self.runs:020d}.json"
        commit.parent.mkdir(parents=True, exist_ok=True)
        with open(commit, "w") as fh:
            fh.write(json.dumps({"files": files}))
            fh.flush()
            os.fsync(fh.fileno())
        return files

    def clear(self) -> None:
        """Untimed: remove what the runs wrote (the DBs stay)."""
        shutil.rmtree(self.out, ignore_errors=True)

    def seconds(self, df: Any, repeats: int) -> float:
        """Median seconds of `repeats` runs over df, each on a cleared output directory."""
        times = []
        for _ in range(repeats):
            self.clear()
            start = time.perf_counter()
            self.run(df)
            times.append(time.perf_counter() - start)
        self.clear()
        return statistics.median(times)

    def warm(self, df: Any) -> None:
        """Untimed: one run, so the workers open the DBs and fill their block caches before anything is timed."""
        self.run(df)
        self.clear()
