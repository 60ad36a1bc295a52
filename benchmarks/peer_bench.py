"""Peer benchmark: one seeded upsert workload through dbidx and the tools users compare it with, each system in its
own subprocess with a time cap, its process tree's peak memory sampled, and its final table checked.

Data (generated once, as Parquet in a temp work dir, so every system reads identical input; the generator is
table_bench.py's `Stream`): `--keys` UUID-shaped string keys `id` over 30 daily partitions `dt`, a 40-byte `payload`
and a version column `ver`; an initial load of every key (ver 0), then `--batches` change batches of `--batch` rows
(default min(100 000, keys / 10)): 80% updates to the last 7 days, 5% late updates to older days, 15% new keys,
`ver` = batch number. Each system starts from the input already in memory (Arrow, or a cached Spark DataFrame).
Systems (a system whose package is missing is skipped with a message, never failed):
  dbidx: Spark `upsert` (dbidx.spark_integration.api) into a `--shards`-shard table, local[2]; read back with
    `reads.read_arrow`.
  delta-rs (deltalake): `write_deltalake` for the load, `DeltaTable.merge` for each batch, once on `id` alone and
    once on (dt, id): two rows.
  pyiceberg: `Table.upsert(join_cols=["id"])` on a SQLite SQL catalog, partitioned by dt (identity); its time cap
    is `--iceberg-timeout` (it is slow, and is reported as a timeout when it runs over).
  pypaimon: a primary-key (dt, id) table with `--shards` buckets, each batch written with the batch writer (the
    primary key deduplicates); a version whose writer cannot write primary-key tables is reported as unsupported.
    Not in the `peers` extra (pypaimon 2.x requires pyarrow<20): `pip install pypaimon` into a venv of its own and
    run `--systems pypaimon` there.
  Spark join (do it yourself): each batch LEFT JOIN a Parquet key index (id -> dt) tags inserts and updates, the
    tagged batch is appended as Parquet and the new keys to the index; read back deduplicated by latest ver.
  Delta Spark (Delta Lake on Spark 4.4.0, loaded into every Spark system's session when the Spark version allows):
    `MERGE INTO` on (dt, id) with deletion vectors on (`spark.databricks.delta.properties.defaults.
    enableDeletionVectors`), the batch's partitions named in the ON clause so Delta prunes the rest; OPTIMIZE for
    the compaction figure.
  Apache Hudi (hudi_peer.py: Hudi 1.2.0 on Spark 3.5.5, in a virtualenv the benchmark builds from PyPI and Maven
    Central on first use and reuses): `bulk_insert`, then `upsert` on record key id, partition path dt, ordering field
    ver, with the metadata table's record index: global (hudi-cow, hudi-mor) or partitioned by dt (hudi-cow-prli,
    hudi-mor-prli), copy-on-write or merge-on-read, Hudi's table services as shipped; run_compaction for the
    merge-on-read compaction figure. Not in `--smoke`'s default systems (the first run builds the environment: a
    minute and the network): `--smoke --systems hudi-cow,hudi-mor` runs them at smoke size.
Per system: initial load seconds, the median and the mean seconds of the batches after the first (batch 1 warms
JVMs, JITs and caches, so it is excluded; the mean also carries what a system does every few batches, e.g. dbidx's
table services after a commit), rows/s of those steady batches, the peak RSS of the system's whole process tree (sampled
every 0.2 s: the JVM and Python workers included), bytes of its table dir, and the check: rows read back == distinct
keys and sum(ver) == the generator's expected sum.
Run: `python benchmarks/peer_bench.py [--keys 2000000] [--batches 5] [--batch N] [--systems dbidx,delta-id,...]
[--timeout 1800] [--smoke] [--write-results]`; one system alone: `--run-one SYSTEM --work DIR` (used internally).
`--smoke` (the test suite's run: 3,000 keys, 3 batches) runs the Spark systems one after the other in one child
process (one per Python environment: Hudi's systems share theirs), so the JVM starts once (a stopped SparkSession's
successor reuses it); their figures are not comparable then.
dbidx's cache settings come from the DBIDX_CACHE_* environment variables (docs/CONFIG.md), e.g.
`DBIDX_CACHE_SERVICE=true python benchmarks/peer_bench.py ...` for the cache service.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
import hudi_peer

SEED = 20261123
SAMPLE_S = 0.2
READS = 3  # timed full reads per system (the best is reported)
# The time cap of a system with an environment of its own at smoke size: Hudi's load took 70 s and each 300-row
# batch 10 s on a busy 2-core machine (every commit also writes the metadata table's four partitions), against the
# 100 s smoke cap of the others.
OWN_ENV_SMOKE_TIMEOUT = 400
HEADERS = [
    "system",
    "status",
    "load s",
    "median s/batch (excl. batch 1)",
    "mean s/batch (excl. batch 1)",
    "median s/batch per round",
    "steady rows/s",
    "peak RSS MiB",
    "table MiB",
    "data files",
    "full read s",
    "polars read s",
    "compact s",
    "read after compact s",
    "check",
]


class Unsupported(Exception):
    """The installed version of a system cannot run this workload (reported as such, not as a failure)."""


# ---------------------------------------------------------------------------------------------------------------
# The data set: generated once, read by every system.


def generate(work: Path, keys: int, batches: int, batch: int) -> dict[str, Any]:
    """Write the load and the change batches as Parquet under work/data; returns the manifest (also saved)."""
    import numpy as np
    from table_bench import Stream  # beside this script; the same data shape as the table benchmark

    data = work / "data"
    data.mkdir(parents=True)
    stream = Stream(keys, np.random.default_rng(SEED))
    pq.write_table(stream.load(), data / "load.parquet")
    paths = []
    for number in range(1, batches + 1):
        paths.append(str(data / f"batch-{number:03d}.parquet"))
        pq.write_table(stream.batch(batch, number), paths[-1])
    rows, sum_ver = stream.expected()
    manifest = {
        "load": str(data / "load.parquet"),
        "batches": paths,
        "batch_rows": batch,
        "rows": rows,
        "sum_ver": sum_ver,
    }
    (work / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def arrow_counts(table: pa.Table) -> tuple[int, int]:
    """(rows, sum of ver) of a table read back."""
    return table.num_rows, int(pc.sum(table.column("ver")).as_py() or 0)


# ---------------------------------------------------------------------------------------------------------------
# The systems. Each has prepare(path) (untimed: the input in memory), load(data), upsert(data), release(data),
# read_all() -> rows (every column into Arrow: the timed read), files() -> live data files (None: not known),
# counts() -> (rows, sum of ver) and close().


class ArrowInput:
    """Systems fed with a pyarrow Table."""

    def prepare(self, path: str) -> pa.Table:
        return pq.read_table(path)

    def release(self, data: Any) -> None:
        pass

    def close(self) -> None:
        pass


class DeltaPeer(ArrowInput):
    def __init__(self, root: Path, predicate: str) -> None:
        import deltalake

        self.deltalake, self.uri, self.predicate = deltalake, str(root), predicate

    def load(self, data: pa.Table) -> None:
        self.deltalake.write_deltalake(self.uri, data, partition_by=["dt"])

    def upsert(self, data: pa.Table) -> None:
        (
            self.deltalake.DeltaTable(self.uri)
            .merge(data, self.predicate, source_alias="s", target_alias="t")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )

    def counts(self) -> tuple[int, int]:
        return arrow_counts(self.deltalake.DeltaTable(self.uri).to_pyarrow_table(columns=["ver"]))

    def read_all(self) -> int:
        return self.deltalake.DeltaTable(self.uri).to_pyarrow_table().num_rows

    def files(self) -> int | None:
        return len(self.deltalake.DeltaTable(self.uri).file_uris())


class IcebergPeer(ArrowInput):
    def __init__(self, root: Path) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        root.mkdir(parents=True)
        self.catalog = SqlCatalog("bench", uri=f"sqlite:///{root / 'catalog.db'}", warehouse=f"file://{root}")
        self.catalog.create_namespace("bench")
        self.table: Any = None

    def load(self, data: pa.Table) -> None:
        self.table = self.catalog.create_table("bench.t", schema=data.schema)
        with self.table.update_spec() as spec:
            spec.add_identity("dt")
        self.table.append(data)

    def upsert(self, data: pa.Table) -> None:
        self.table.upsert(data, join_cols=["id"])

    def counts(self) -> tuple[int, int]:
        return arrow_counts(self.catalog.load_table("bench.t").scan(selected_fields=("ver",)).to_arrow())

    def read_all(self) -> int:
        return self.catalog.load_table("bench.t").scan().to_arrow().num_rows

    def files(self) -> int | None:
        return len(list(self.catalog.load_table("bench.t").scan().plan_files()))


class PaimonPeer(ArrowInput):
    def __init__(self, root: Path, buckets: int) -> None:
        from pypaimon import CatalogFactory

        self.catalog = CatalogFactory.create({"warehouse": str(root)})
        self.catalog.create_database("bench", False)
        self.buckets = buckets

    def load(self, data: pa.Table) -> None:
        from pypaimon import Schema

        schema = Schema.from_pyarrow_schema(
            data.schema, partition_keys=["dt"], primary_keys=["dt", "id"], options={"bucket": str(self.buckets)}
        )
        self.catalog.create_table("bench.t", schema, False)
        if not self.catalog.get_table("bench.t").is_primary_key_table:
            raise Unsupported(f"pypaimon {version('pypaimon')} did not create a primary-key table")
        self.upsert(data)

    def upsert(self, data: pa.Table) -> None:
        builder = self.catalog.get_table("bench.t").new_batch_write_builder()
        writer, commit = builder.new_write(), builder.new_commit()
        try:
            writer.write_arrow(data)
            commit.commit(writer.prepare_commit())
        except NotImplementedError as exc:
            raise Unsupported(f"pypaimon {version('pypaimon')} cannot write primary-key tables: {exc}") from exc
        finally:
            writer.close()
            commit.close()

    def counts(self) -> tuple[int, int]:
        builder = self.catalog.get_table("bench.t").new_read_builder()
        return arrow_counts(builder.new_read().to_arrow(builder.new_scan().plan().splits()))

    def read_all(self) -> int:
        return self.counts()[0]

    def files(self) -> int | None:
        return None


def delta_spark_runs() -> bool:
    """Whether Delta Lake on Spark can load beside this Spark (its jars are built for one minor version)."""
    import pyspark

    from dbidx.spark_integration.delta_spark import SPARK_VERSION

    return pyspark.__version__.split(".")[:2] == SPARK_VERSION.split(".")[:2]


def spark_session(work: Path, shards: int):
    """Every Spark system's session loads Delta Spark when it can: one JVM serves them all at smoke size, and a team
    on Delta Spark runs dbidx in such a session."""
    return _report.spark_session(work / "spark-local", shards, "dbidx-peer-bench", delta=delta_spark_runs())


class SparkInput(_report.CachedFrames):
    """Systems fed with a cached Spark DataFrame, on the project's Spark."""

    def __init__(self, work: Path, shards: int) -> None:
        self.spark = spark_session(work, shards)


class DbidxPeer(SparkInput):
    def __init__(self, root: Path, work: Path, shards: int) -> None:
        super().__init__(work, shards)
        from dbidx.config import CacheConfig
        from dbidx.table.facade import Table

        self.table = Table.open_or_create(str(root), num_shards=shards)
        # DBIDX_CACHE_* environment variables apply (an A/B of a cache setting, e.g. DBIDX_CACHE_SERVICE=true).
        self.config = CacheConfig.from_sources({"base_path": str(work / "dbidx-cache")})

    def load(self, data: Any) -> None:
        self.upsert(data)

    def upsert(self, data: Any) -> None:
        from dbidx.spark_integration.api import upsert

        upsert(data, self.table, key="id", partition="dt", cache_config=self.config)

    def counts(self) -> tuple[int, int]:
        from dbidx.data import reads

        return arrow_counts(reads.read_arrow(self.table, columns=["ver"]))

    def close(self) -> None:
        """Stop the cache services the batches started (DBIDX_CACHE_SERVICE=true), then Spark."""
        from dbidx.cache.record_cache import RecordIndexCache
        from dbidx.cache.service_link import request_stop

        for shard in range(self.table.num_shards):
            request_stop(RecordIndexCache.for_table(self.table, shard, self.config).path)
        super().close()

    def read_all(self) -> int:
        from dbidx.data import reads

        return reads.read_arrow(self.table).num_rows

    def files(self) -> int | None:
        return len(self.table.data_view().live())

    def compact(self) -> None:
        """`dbidx compact --data` on the data files (the index is left as it is: reads do not use it)."""
        self.table.compact_data()


class SparkJoinPeer(SparkInput):
    """The do-it-yourself baseline: a Parquet key index (id -> dt) joined with each batch; merge on read."""

    def __init__(self, root: Path, work: Path, shards: int) -> None:
        super().__init__(work, shards)
        self.data_dir, self.index_dir = str(root / "data"), str(root / "index")

    def load(self, data: Any) -> None:
        from pyspark.sql import functions as F

        data.withColumn("_op", F.lit("insert")).write.mode("append").partitionBy("dt").parquet(self.data_dir)
        data.select("id", "dt").write.mode("append").parquet(self.index_dir)

    def upsert(self, data: Any) -> None:
        from pyspark.sql import functions as F

        index = self.spark.read.parquet(self.index_dir).select("id", F.col("dt").alias("_indexed_dt"))
        tagged = (
            data.join(index, "id", "left")
            .withColumn("_op", F.when(F.col("_indexed_dt").isNull(), "insert").otherwise("update"))
            .drop("_indexed_dt")
            .cache()
        )
        try:
            tagged.write.mode("append").partitionBy("dt").parquet(self.data_dir)
            tagged.filter(F.col("_op") == "insert").select("id", "dt").write.mode("append").parquet(self.index_dir)
        finally:
            tagged.unpersist()

    def counts(self) -> tuple[int, int]:
        from pyspark.sql import functions as F

        latest = self.spark.read.parquet(self.data_dir).groupBy("id").agg(F.max("ver").alias("ver"))
        row = latest.agg(F.count("*"), F.sum("ver")).first()
        return int(row[0]), int(row[1] or 0)

    def read_all(self) -> int:
        return self.counts()[0]  # the merge on read is the read

    def files(self) -> int | None:
        return len(self.spark.read.parquet(self.data_dir).inputFiles())


class DeltaSparkPeer(SparkInput):
    """Delta Lake on Spark's own upsert: `MERGE INTO` the Delta table on (dt, id) with deletion vectors on (merge on
    read, the work dbidx does), written as a Delta engineer would so that files prune: the ON clause names the
    batch's partitions as literals (`t.dt IN (...)`), which Delta uses to skip every other partition's files."""

    def __init__(self, root: Path, work: Path, shards: int) -> None:
        super().__init__(work, shards)
        self.uri = str(root)

    def load(self, data: Any) -> None:
        if not delta_spark_runs():
            raise Unsupported("Delta Spark 4.4's jars need Spark 4.2 (pip install -e '.[dev]')")
        data.write.format("delta").partitionBy("dt").save(self.uri)

    def upsert(self, data: Any) -> None:
        days = sorted(r[0] for r in data.select("dt").distinct().collect())
        listed = ", ".join("'" + d.replace("'", "''") + "'" for d in days)
        data.createOrReplaceTempView("peer_batch")
        self.spark.sql(
            f"""MERGE INTO delta.`{self.uri}` t USING peer_batch s
            ON t.dt IN ({listed}) AND t.dt = s.dt AND t.id = s.id
            WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"""
        )

    def counts(self) -> tuple[int, int]:
        from pyspark.sql import functions as F

        row = self.spark.read.format("delta").load(self.uri).agg(F.count("*"), F.sum("ver")).first()
        return int(row[0]), int(row[1] or 0)

    def read_all(self) -> int:
        return self.spark.read.format("delta").load(self.uri).count()

    def files(self) -> int | None:
        return len(self.spark.read.format("delta").load(self.uri).inputFiles())

    def compact(self) -> None:
        """Delta's OPTIMIZE (bin-packing; it also purges the rows deletion vectors hide)."""
        self.spark.sql(f"OPTIMIZE delta.`{self.uri}`")


@dataclass(frozen=True)
class System:
    label: str  # as the results table names it
    package: str  # the distribution that must be installed (in the system's own environment when it has one)
    make: Callable[[Path, Path, int], Any]  # (table dir, work dir, shards) -> the system's object
    # A system on a Spark other than this environment's: the Python of its own environment, built on first call
    # (RuntimeError or OSError when it cannot be: the system is skipped); its child runs on that Python. None: this
    # environment.
    python: Callable[[], Path] | None = None


SYSTEMS: dict[str, System] = {
    "dbidx": System("dbidx", "pyspark", lambda root, work, shards: DbidxPeer(root, work, shards)),
    "delta-id": System("delta-rs merge on id", "deltalake", lambda root, work, shards: DeltaPeer(root, "t.id = s.id")),
    "delta-dt-id": System(
        "delta-rs merge on (dt, id)",
        "deltalake",
        lambda root, work, shards: DeltaPeer(root, "t.dt = s.dt and t.id = s.id"),
    ),
    "pyiceberg": System("pyiceberg upsert on id", "pyiceberg", lambda root, work, shards: IcebergPeer(root)),
    "pypaimon": System(
        "pypaimon primary key (dt, id)", "pypaimon", lambda root, work, shards: PaimonPeer(root, shards)
    ),
    "spark-join": System(
        "Spark join + Parquet (DIY)", "pyspark", lambda root, work, shards: SparkJoinPeer(root, work, shards)
    ),
    "delta-spark": System(
        "Delta Spark MERGE INTO on (dt, id), DVs on",
        "pyspark",
        lambda root, work, shards: DeltaSparkPeer(root, work, shards),
    ),
    "hudi-cow": System(
        "Hudi upsert, copy-on-write, global record index",
        "pyspark",
        lambda root, work, shards: hudi_peer.HudiPeer(root, work, shards, partitioned_index=False),
        hudi_peer.ensure_env,
    ),
    "hudi-mor": System(
        "Hudi upsert, merge-on-read, global record index",
        "pyspark",
        lambda root, work, shards: hudi_peer.HudiMergeOnReadPeer(root, work, shards, partitioned_index=False),
        hudi_peer.ensure_env,
    ),
    "hudi-cow-prli": System(
        "Hudi upsert, copy-on-write, partitioned record index",
        "pyspark",
        lambda root, work, shards: hudi_peer.HudiPeer(root, work, shards, partitioned_index=True),
        hudi_peer.ensure_env,
    ),
    "hudi-mor-prli": System(
        "Hudi upsert, merge-on-read, partitioned record index",
        "pyspark",
        lambda root, work, shards: hudi_peer.HudiMergeOnReadPeer(root, work, shards, partitioned_index=True),
        hudi_peer.ensure_env,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# One system, in its own process: progress is saved after every step, so a timeout still shows what was done.


@dataclass
class Progress:
    load_s: float | None = None
    batch_s: list[float] = field(default_factory=list)
    rows: int | None = None
    sum_ver: int | None = None
    table_bytes: int | None = None
    read_s: float | None = None
    polars_s: float | None = None  # -1: polars did not finish within POLARS_LIMIT_S (killed)
    files: int | None = None
    compact_s: float | None = None  # systems that compact data files on request (dbidx: compact_data)
    compacted_read_s: float | None = None
    unsupported: str | None = None
    note: str | None = None  # what the system reports of its table (Hudi: type, index, the table services' actions)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)


def timed_step(system: Any, path: str, step: Callable[[Any], None]) -> float:
    data = system.prepare(path)
    start = time.perf_counter()
    step(data)
    seconds = time.perf_counter() - start
    system.release(data)
    return seconds


def best_of(runs: int, read: Callable[[], Any]) -> float:
    """The fastest of `runs` timed calls (warm reads: the first one also pays imports and first-use setup)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return min(times)


POLARS_LIMIT_S = 120
_POLARS_CHILD = """
import sys, time
import polars
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    polars.read_delta(sys.argv[1])
    times.append(time.perf_counter() - start)
print(min(times))
"""


def polars_read_s(path: str) -> float:
    """The best of READS polars reads of a Delta table, in a process of its own with a time limit: polars (through
    delta-rs) deadlocks planning a scan of a table with more file-backed deletion vectors than its runtime has
    blocking threads (delta-io/delta-rs#4657), which Delta Spark's own MERGE tables reach; -1 when it did not finish."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _POLARS_CHILD, path, str(READS)],
            capture_output=True,
            text=True,
            timeout=POLARS_LIMIT_S,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return -1.0
    return float(done.stdout.strip().splitlines()[-1])


def run_one(name: str, work: Path, shards: int) -> None:
    """Run one system over the generated data; its figures go to work/<name>.json."""
    manifest = json.loads((work / "manifest.json").read_text())
    out, progress = work / f"{name}.json", Progress()
    system = SYSTEMS[name].make(work / name, work / f"{name}-scratch", shards)
    try:
        progress.load_s = timed_step(system, manifest["load"], system.load)
        progress.save(out)
        for path in manifest["batches"]:
            progress.batch_s.append(timed_step(system, path, system.upsert))
            progress.save(out)
        progress.read_s = best_of(READS, system.read_all)
        progress.files = system.files()
        if isinstance(system, (DeltaPeer, DbidxPeer, DeltaSparkPeer)) and installed("polars"):
            progress.polars_s = polars_read_s(str(work / name))
        progress.rows, progress.sum_ver = system.counts()
        progress.table_bytes = _report.dir_bytes(work / name)
        if hasattr(system, "note"):
            progress.note = system.note()
        if hasattr(system, "compact"):
            progress.save(out)
            start = time.perf_counter()
            system.compact()
            progress.compact_s = time.perf_counter() - start
            progress.compacted_read_s = best_of(READS, system.read_all)
            if system.counts() != (progress.rows, progress.sum_ver):
                progress.rows = -1  # the compacted table reads other rows: the check says WRONG
    except Unsupported as exc:
        progress.unsupported = str(exc)
    finally:
        progress.save(out)
        system.close()


# ---------------------------------------------------------------------------------------------------------------
# The parent: one child per system, a time cap, and the process tree's RSS sampled.


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    return sum(_report.tree_rss_each(pid))


@dataclass
class Outcome:
    status: str
    progress: Progress
    peak_rss: int = 0


def kill_tree(proc: subprocess.Popen) -> None:
    """The child leads its own process group (start_new_session): end the group, JVM and workers included."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def supervise(
    names: list[str], work: Path, args: argparse.Namespace, timeout: float, python: Path | None = None
) -> dict[str, Outcome]:
    """Run `names` in one child (normally one system; at smoke size the Spark systems of one environment share a
    child, so one JVM start is paid), under one time cap; each system's outcome from its own figures file. `python`:
    the interpreter of the systems' own environment (None: this one), the Spark workers' too."""
    command = [
        str(python or sys.executable),
        str(Path(__file__).resolve()),
        "--run-one",
        ",".join(names),
        "--work",
        str(work),
        "--shards",
        str(args.shards),
    ]
    log = work / f"{'+'.join(names)}.log"
    with open(log, "w") as sink:
        environ = None if python is None else hudi_peer.isolated_env(python)
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=environ)
        peak, start, timed_out = 0, time.monotonic(), False
        try:
            while proc.poll() is None:
                peak = max(peak, tree_rss(proc.pid))
                if time.monotonic() - start > timeout:
                    timed_out = True
                    break
                time.sleep(SAMPLE_S)
        finally:
            kill_tree(proc)
    outcomes = {}
    for name in names:
        result = work / f"{name}.json"
        progress = Progress(**json.loads(result.read_text())) if result.exists() else Progress()
        if timed_out:
            status = f"timeout at {timeout:.0f} s ({len(progress.batch_s)}/{args.batches} batches)"
        elif proc.returncode != 0:
            status = f"failed (exit {proc.returncode}): {last_line(log)}"
        elif progress.unsupported:
            status = f"unsupported: {progress.unsupported}"
        else:
            status = "ok"
        outcomes[name] = Outcome(status, progress, peak)
    if not timed_out and proc.returncode != 0:
        print(f"--- {'+'.join(names)} failed; the end of its log:\n{tail(log, 25)}", file=sys.stderr)
    return outcomes


def tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return (lines[-1][:160] if lines else "no output").replace("|", "/")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check(progress: Progress, manifest: dict[str, Any]) -> str:
    if progress.rows is None:
        return "-"
    got, expected = (progress.rows, progress.sum_ver), (manifest["rows"], manifest["sum_ver"])
    return "ok" if got == expected else f"WRONG: (rows, sum ver) = {got}, expected {expected}"


def steady_batches(rounds: list[Outcome]) -> list[float]:
    """Every round's batch seconds but its batch 1 (each round starts a fresh process and table: its batch 1 is a
    warm-up again)."""
    return [s for outcome in rounds for s in outcome.progress.batch_s[1:]]


def status_of(rounds: list[Outcome]) -> str:
    """The status of the first round that was not ok, naming it when there were several rounds; else ok."""
    bad = [(number, o.status) for number, o in enumerate(rounds, 1) if o.status != "ok"]
    if not bad:
        return rounds[-1].status
    return bad[0][1] if len(rounds) == 1 else f"round {bad[0][0]}: {bad[0][1]}"


def median_load(rounds: list[Outcome]) -> float | None:
    """The median of the rounds' load seconds (None if no round loaded)."""
    loads = [o.progress.load_s for o in rounds if o.progress.load_s is not None]
    return statistics.median(loads) if loads else None


def row(name: str, rounds: list[Outcome], manifest: dict[str, Any]) -> list[Any]:
    """A system's table row over its rounds: the median and mean of all their steady batches, each round's own
    median beside them (the spread a single run hides), the median load; the reads and files of the last round; the
    status of the first round that was not ok (else ok), the first wrong read-back of any round (else the last
    round's check) and the highest peak RSS."""
    progress = rounds[-1].progress
    steady = steady_batches(rounds)
    median = statistics.median(steady) if steady else None
    load = median_load(rounds)
    per_round = [
        f"{statistics.median(o.progress.batch_s[1:]):.3f}" if len(o.progress.batch_s) > 1 else "-" for o in rounds
    ]
    checks = [check(o.progress, manifest) for o in rounds]
    peak = max(o.peak_rss for o in rounds)
    return [
        SYSTEMS[name].label,
        status_of(rounds),
        "-" if load is None else round(load, 3),
        "-" if median is None else round(median, 3),
        round(statistics.fmean(steady), 3) if steady else "-",
        " / ".join(per_round),
        "-" if not median else round(manifest["batch_rows"] / median),
        round(peak / (1 << 20)) if peak else "-",
        "-" if progress.table_bytes is None else round(progress.table_bytes / (1 << 20), 1),
        "-" if progress.files is None else progress.files,
        "-" if progress.read_s is None else progress.read_s,
        "-"
        if progress.polars_s is None
        else f"hung (> {POLARS_LIMIT_S} s)"
        if progress.polars_s < 0
        else progress.polars_s,
        "-" if progress.compact_s is None else progress.compact_s,
        "-" if progress.compacted_read_s is None else progress.compacted_read_s,
        next((c for c in checks if c.startswith("WRONG")), checks[-1]),  # a wrong read-back in any round shows
    ]


def skipped_row(name: str, why: str) -> list[Any]:
    return [SYSTEMS[name].label, f"skipped: {why}"] + ["-"] * (len(HEADERS) - 2)


def versions() -> str:
    names = ["pyspark", "deltalake", "pyiceberg", "pypaimon", "psutil"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    hudi = hudi_peer.describe()
    return ", ".join(found + ([hudi + ", in a virtualenv of its own"] if hudi else []))


def run_all(args: argparse.Namespace, names: list[str]) -> tuple[list[list[Any]], dict[str, Any], float]:
    """Generate the data, run every system; returns the table rows, the figures for the chart and the
    generation seconds."""
    work = Path(tempfile.mkdtemp(prefix="dbidx-peer-bench-"))
    rows: list[list[Any]] = []
    figures: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        manifest = generate(work, args.keys, args.batches, args.batch)
        generate_s = time.perf_counter() - start
        runnable = []
        pythons: dict[str, Path] = {}  # the systems that run in an environment of their own -> its Python
        unbuilt: dict[str, str] = {}
        for name in names:
            system = SYSTEMS[name]
            if system.python is not None:
                try:
                    pythons[name] = system.python()
                except (RuntimeError, OSError) as exc:  # a step that failed, or a cache dir that cannot be written
                    print(f"{system.label}: {exc}", file=sys.stderr)
                    unbuilt[name] = str(exc).replace("|", "/")[:300]
                    runnable.append((name, None))
                    continue
                runnable.append((name, max(args.timeout, OWN_ENV_SMOKE_TIMEOUT) if args.smoke else args.timeout))
            elif not installed(system.package):
                hint = "pip install pypaimon (needs pyarrow<20)" if name == "pypaimon" else "pip install -e '.[peers]'"
                print(f"{system.label}: {system.package} is not installed, skipped ({hint})", file=sys.stderr)
                runnable.append((name, None))
            else:
                runnable.append((name, args.iceberg_timeout if name == "pyiceberg" else args.timeout))
        # One child per system; at smoke size the Spark systems of one environment share one child (one JVM start,
        # not one each), started with the first of them.
        shared = [
            name
            for name, timeout in runnable
            if timeout is not None and args.smoke and SYSTEMS[name].package == "pyspark"
        ]
        # Each round runs every system once, in turns: the order flips from round to round (A B, B A, ...), so a
        # machine that drifts slower or faster during the run weighs on every system alike.
        rounds: dict[str, list[Outcome]] = {name: [] for name, timeout in runnable if timeout is not None}
        for number in range(args.rounds):
            order = runnable if number % 2 == 0 else runnable[::-1]
            done: set[str] = set()
            for name, timeout in order:
                if timeout is None or name in done:
                    continue
                group = [n for n in shared if pythons.get(n) == pythons.get(name)] if name in shared else [name]
                caps = [t for n, t in runnable if n in group]
                for member in group:  # a round that dies before its first figures must not read the last round's
                    (work / f"{member}.json").unlink(missing_ok=True)
                for member, outcome in supervise(group, work, args, sum(caps), pythons.get(name)).items():
                    rounds[member].append(outcome)
                    done.add(member)
                    print(f"{SYSTEMS[member].label} (round {number + 1}): {outcome.status}", file=sys.stderr)
                for member in group:
                    shutil.rmtree(work / member, ignore_errors=True)
                    shutil.rmtree(work / f"{member}-scratch", ignore_errors=True)
        for name, timeout in runnable:
            system = SYSTEMS[name]
            if timeout is None:
                why = (
                    f"environment not built: {unbuilt[name]}" if name in unbuilt else f"{system.package} not installed"
                )
                rows.append(skipped_row(name, why))
                continue
            rows.append(row(name, rounds[name], manifest))
            first = rounds[name][0].progress.batch_s[:1]
            figures[name] = {
                "label": system.label,
                "status": status_of(rounds[name]),
                "load_s": median_load(rounds[name]),
                "batch_s": first + steady_batches(rounds[name]),  # batch 1 of round 1, then every steady batch
                "rounds_batch_s": [o.progress.batch_s for o in rounds[name]],
                "peak_rss": max(o.peak_rss for o in rounds[name]),
                "check": rows[-1][-1],
                "note": rounds[name][-1].progress.note,
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows, figures, generate_s


def notes(systems: dict[str, Any]) -> list[str]:
    """The systems' own words on their tables (Hudi: table type, index and what its table services did), one line
    each, under the table; [] when none has any."""
    lines = [f"- {figures['label']}: {figures['note']}" for figures in systems.values() if figures.get("note")]
    return (
        ["Tables as written (after the batches, before the compaction figure's compaction):\n\n" + "\n".join(lines)]
        if lines
        else []
    )


def write_results(args: argparse.Namespace, body: str, systems: dict[str, Any]) -> str:
    """This size's RESULTS.md section; its figures merged into results/peers.json with the other sizes; the chart
    (seconds per batch by table size) once two sizes or more are there."""
    import charts  # beside this script

    _report.write_section(f"peers-{args.keys}", body)
    saved = charts.RESULTS_DIR / "peers.json"
    runs = json.loads(saved.read_text()).get("runs", {}) if saved.exists() else {}
    runs[str(args.keys)] = {
        "keys": args.keys,
        "batch_rows": args.batch,
        "batches": args.batches,
        "command": _report.command(),
        "systems": systems,
    }
    _report.write_figures("peers", {"runs": runs})
    drawn = charts.draw("peers")
    if drawn:
        _report.write_section(
            "peers-chart", "## Peers: seconds per change batch by table size\n\n" + charts.links(drawn)
        )
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="rows per batch; default min(100000, keys / 10)")
    parser.add_argument("--shards", type=int, default=2, help="dbidx key shards, paimon buckets, Spark partitions")
    parser.add_argument(
        "--systems",
        help=f"comma separated, of {', '.join(SYSTEMS)}; default all (with --smoke: all but those with an "
        "environment of their own, i.e. Hudi's)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per system")
    parser.add_argument("--iceberg-timeout", type=float, default=600, help="seconds for pyiceberg")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, in turns (the order flips each round); the table gives the median "
        "of all their steady batches and each round's own",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)  # comma separated: run one after the other
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        for name in args.run_one.split(","):
            run_one(name, args.work, args.shards)
        return
    if args.smoke:
        args.keys, args.batches, args.timeout, args.iceberg_timeout = 3_000, 3, 100, 100
    args.batch = args.batch or min(100_000, args.keys // 10)
    if args.batches < 2:
        parser.error("--batches must be at least 2 (batch 1 is excluded from the median)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.systems is None:
        args.systems = ",".join(n for n in SYSTEMS if not (args.smoke and SYSTEMS[n].python is not None))
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    rows, systems, generate_s = run_all(args, names)
    body = "\n\n".join(
        [
            f"## Upserts at {args.keys:,} keys: dbidx and its peers, each system in its own process",
            f"Machine: {_report.machine()}; {versions()}. Command: `{_report.command()}`. {args.keys:,} UUID keys over 30 "
            f"daily partitions loaded at once, then {args.batches} batches of {args.batch:,} rows (80% updates to the last "
            f"7 days, 5% late updates, 15% new keys; generated once in {generate_s:.1f} s, identical for every system). "
            + (
                f"Every system ran {args.rounds} times, in turns (the order flipped each round: a machine drifting "
                "during the run weighs on all alike); median and mean are over all rounds' batches, each round's "
                "own median beside them; load is the median of their loads, reads and files the last round's. "
                if args.rounds > 1
                else ""
            )
            + f"Median and mean s/batch leave out batch 1 (warm-up); the mean carries what a system does every few batches "
            f"(dbidx: the table services after a commit, a data compaction every 10 batches); rows/s = batch rows / "
            f"the median. Peak RSS: the system's "
            f"whole process tree (JVM and Python workers included), sampled every {SAMPLE_S} s. Table MiB: the table "
            f"dir (dbidx: data and index files; its executor-local cache is not counted). Data files: live data files "
            f"after the batches. Full read (best of {READS}): every column into one Arrow table, in the process that "
            f"wrote (dbidx: `read_arrow`, files minus deletion vectors; delta-rs: `to_pyarrow_table`; pyiceberg: "
            f"`scan().to_arrow`; pypaimon: its reader; Spark join: the latest-per-key aggregate; Delta Spark: a count; Hudi: "
            f"every column of a snapshot read into Spark's noop sink); "
            f"polars read (best of {READS}, in a process of its own, at most {POLARS_LIMIT_S} s: delta-rs deadlocks on "
            "hundreds of file-backed deletion vectors, delta-io/delta-rs#4657): `polars.read_delta` of the same table "
            "through its Delta log (the Delta tables only). Compact s: dbidx's data compaction after the reads "
            f"(`compact_data()`: each file group's small files into one; Delta Spark: OPTIMIZE; Hudi "
            f"merge-on-read: run_compaction), then "
            f"read after compact s: the full read again (best of {READS}). Check: rows read back == "
            f"distinct keys and sum(ver) as generated. Spark systems run local[2] with {args.shards} shards; time cap "
            f"{args.timeout:.0f} s per system, {args.iceberg_timeout:.0f} s for pyiceberg."
            + (
                " Smoke size: the Spark systems ran one after the other in one process (one JVM), so their peak RSS is "
                "that process's."
                if args.smoke
                else ""
            ),
            _report.table(HEADERS, rows),
        ]
        + notes(systems)
    )
    if args.write_results and not args.smoke:
        body = write_results(args, body, systems)
    print(body)
    if any(r[-1].startswith("WRONG") for r in rows):
        raise SystemExit("a system read back a wrong table (see the check column)")


if __name__ == "__main__":
    main()
