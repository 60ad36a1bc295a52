"""Speed benchmark: dbidx at and around the steady state, each figure beside an anchor measured in the same run.

What is measured, in one run (Spark local[2], `--shards` key shards, every input a cached DataFrame):
  1. Steady batch: dbidx `upsert` seconds of the change batches after batch 1 (median), against the work floor of
     the same batches (work_floor.py: the same job shape doing only what no upsert can avoid - a multi-get of each
     task's keys, sorted, in an open, warm RocksDB holding the table's keys, one zstd Parquet file per partition
     touched, one fsynced commit file; median of 3 runs per batch after an untimed one). Goal: <= 1.3x the work
     floor. Beside it, the Spark floor of the same batches: an empty job of the upsert's shape on the same cached
     DataFrame (repartition into `--shards` partitions by the key cast to string, `mapInArrow` reading every Arrow
     batch and yielding one row per task, collected; median of 3). Per batch, the upsert's driver phases
     (summary.phases) and its slowest shard's open, sync, tag and write seconds.
  2. Initial load: dbidx `upsert` of the whole load into the empty table (the bulk path), against Spark writing the
     same cached rows as Parquet partitioned by `dt` after a repartition by key into `--shards` partitions (and,
     as an extra row, without the repartition); the peak RSS of the largest process and of the whole process tree
     (driver, Spark JVM, Python workers), sampled every 0.2 s. Goals: <= 1.3x the shuffled write, largest process
     <= 2 GB.
  3. First batch after the load: batch 1, on the caches the load left, against the steady median. Goal: <= 2x.
  4. Warm restart vs full re-bootstrap after K = 50 commits at `--restart-keys` keys (restart_bench.warm_vs_full,
     no Spark). Goal: full / warm >= 20x.
  5. Lookup path vs raw rocksdict multi-get: one warm partition of a `--keys`-entry cache, `--batch` keys
     (cache_bench.measure_lookups, no Spark). Goal: >= 0.8x.
  6. Optional, `--scale-keys A,B`: warm tagging s/batch at B keys vs at A keys (scale_bench.run_size). Goal: <= 1.2x.
Untimed warm-ups run first for both sides (a floor job, a small Spark Parquet write, a small dbidx upsert into a
scratch table), so JVM and Python-worker start-up bias neither; then the Spark write anchors, the dbidx load, and
the batches, each after its floor runs. At the end the table is read back (`reads.read_arrow`) and checked:
rows == distinct keys, sum(ver) == the generator's; a mismatch is reported and the script exits non-zero.
Data: peer_bench.generate into `--work` (reused when it holds a data set of the same size; without `--work` a
temporary dir, removed at the end): `--keys` UUID keys over 30 daily partitions `dt`, then `--batches` batches of
`--batch` rows (80% updates of the last 7 days, 5% late updates, 15% new keys), `ver` = batch number.
Run: `python benchmarks/speed_bench.py [--keys 2000000] [--batches 5] [--batch 100000] [--shards 2] [--work DIR]
[--restart-keys N] [--scale-keys A,B] [--skip restart,lookup] [--write-results] [--smoke]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
import cache_bench
import peer_bench
import restart_bench
import work_floor

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.table.facade import Table

KEY, PARTITION = "id", "dt"
FLOOR_REPEATS = 3
WARMUP_ROWS = 1_000
RESTART_K, RESTART_COMMIT_KEYS, RESTART_REPEATS = 50, 10_000, 3
LOOKUP_PARTITIONS, LOOKUP_REPEATS = 30, 5
SCALE_REPEATS = 3
MIB = 1 << 20
LARGEST_GOAL_BYTES = 2 << 30
SKIPPABLE = ("restart", "lookup")
HEADERS = ["figure", "dbidx", "anchor", "ratio", "goal", "met"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The data set.


def expected_rows(keys: int, batches: int, batch: int) -> int:
    """Distinct keys after the batches: each brings batch - int(0.8 batch) - int(0.05 batch) new keys."""
    return keys + batches * (batch - int(batch * 0.80) - int(batch * 0.05))


def fits(manifest_path: Path, keys: int, batches: int, batch: int) -> dict[str, Any] | None:
    """The manifest at this path if it describes a data set of this size whose files are all there."""
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    same = (
        manifest.get("batch_rows") == batch
        and len(manifest.get("batches", [])) == batches
        and manifest.get("rows") == expected_rows(keys, batches, batch)
    )
    files = [manifest.get("load", "")] + manifest.get("batches", [])
    return manifest if same and all(Path(f).exists() for f in files) else None


def dataset(work: Path, keys: int, batches: int, batch: int) -> tuple[dict[str, Any], str]:
    """The data set of this size: work's own if it has one, else one in a size-named subdir (generated there if
    missing, so another data set in work is never overwritten). Returns (manifest, how it was obtained)."""
    sized = work / f"speed-data-{keys}-{batches}x{batch}"
    for place in (work, sized):
        manifest = fits(place / "manifest.json", keys, batches, batch)
        if manifest is not None:
            return manifest, "reused from an earlier run"
    place = work if not (work / "manifest.json").exists() and not (work / "data").exists() else sized
    shutil.rmtree(place / "data", ignore_errors=True)  # a partial earlier generation of this size
    start = time.perf_counter()
    manifest = peer_bench.generate(place, keys, batches, batch)
    return manifest, f"generated in {time.perf_counter() - start:.1f} s"


# ---------------------------------------------------------------------------------------------------------------
# Spark: the inputs, the floor job, the Parquet write anchors, dbidx's upserts.


def cached(spark: Any, path: str) -> tuple[Any, int]:
    """The Parquet file as a DataFrame cached in Spark memory, and its rows (counting fills the cache), so timings
    see none of the read."""
    frame = spark.read.parquet(path).cache()
    return frame, frame.count()


def floor_job(df: Any, shards: int) -> None:
    """The empty job of an upsert's shape: the same shuffle by key, every row to a Python worker as Arrow."""
    from pyspark.sql import functions as F

    def consume(batches: Any) -> Any:  # nested: shipped by value, so workers need not import this script
        rows = 0
        for batch in batches:
            rows += batch.num_rows
        yield pa.RecordBatch.from_pydict({"n": [rows]})

    df.repartition(shards, F.col(KEY).cast("string")).mapInArrow(consume, "n long").collect()


def floor_seconds(df: Any, shards: int) -> float:
    """Median seconds of FLOOR_REPEATS floor jobs."""
    return statistics.median(_report.seconds_of(lambda: floor_job(df, shards)) for _ in range(FLOOR_REPEATS))


def parquet_write(df: Any, out: Path, shards: int | None) -> None:
    """Spark's own partitioned Parquet write; with `shards`, after a repartition by key into that many partitions."""
    from pyspark.sql import functions as F

    frame = df if shards is None else df.repartition(shards, F.col(KEY))
    frame.write.mode("overwrite").partitionBy(PARTITION).parquet(str(out))


def tree_rss_named(pid: int) -> list[tuple[str, int]]:
    """(role, resident bytes) of a process and each of its descendants: "driver" (pid itself), "JVM" or "Python
    worker" (with psutil; without it every role is "?")."""
    procs = _report.tree_processes(pid)
    if procs is None:
        return [("?", size) for size in _report.tree_rss_each(pid)]
    import psutil  # tree_processes found it

    named = []
    for proc in procs:
        try:
            # By what the process runs, not by elimination: a short-lived child of the JVM (a forked helper) is
            # neither, and must not pass for a Python worker.
            command = " ".join(proc.cmdline()[:2]).lower()
            role = (
                "driver"
                if proc.pid == pid
                else "JVM"
                if "java" in proc.name().lower() or "/java" in command
                else "Python worker"
                if "python" in command
                else "other"
            )
            named.append((role, proc.memory_info().rss))
        except psutil.Error:
            pass
    return named


class Rss(_report.TreeRss):
    """_report.TreeRss that also keeps the tree's size when the step began and names the largest process."""

    def __init__(self) -> None:
        super().__init__()
        self.at_start: tuple[int, int] | None = None
        self.largest_role = "?"
        self.largest_python = 0  # the driver's Python process or a Python worker: what dbidx's own code holds

    def _sample(self) -> None:
        sizes = tree_rss_named(self.pid) or [("?", 0)]
        role, largest = max(sizes, key=lambda s: s[1])
        total = sum(size for _, size in sizes)
        if self.at_start is None:
            self.at_start = (largest, total)
        if largest > self.largest:
            self.largest, self.largest_role = largest, role
        self.largest_python = max(
            [self.largest_python] + [size for r, size in sizes if r in ("driver", "Python worker")]
        )
        self.total = max(self.total, total)


@dataclass
class Measured:
    """A timed step: wall seconds, peak RSS (largest process and its role, process tree; and both when the step
    began) and, for dbidx, its summary."""

    seconds: float
    largest: int = 0
    total: int = 0
    largest_role: str = "?"
    start_largest: int = 0
    start_total: int = 0
    summary: dict[str, Any] = field(default_factory=dict)
    largest_python: int = 0


def measured(fn: Any) -> Measured:
    """Time fn() with the process tree's RSS sampled; fn's result, a dict, becomes the summary."""
    with Rss() as rss:
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
    return peaks(rss, elapsed, result if isinstance(result, dict) else {})


def peaks(rss: Rss, elapsed: float = 0.0, summary: dict[str, Any] | None = None) -> Measured:
    """A Measured from a finished sampler (and the step's seconds and summary, if any)."""
    start_largest, start_total = rss.at_start or (0, 0)
    return Measured(
        elapsed, rss.largest, rss.total, rss.largest_role, start_largest, start_total, summary or {}, rss.largest_python
    )


class Dbidx:
    """The dbidx table under test and its executor-local caches."""

    def __init__(self, root: Path, caches: Path, shards: int, settings: dict[str, str]) -> None:
        self.table = Table.open_or_create(str(root), num_shards=shards)
        self.config = CacheConfig.from_sources({**settings, "base_path": str(caches)})

    def upsert(self, df: Any) -> dict[str, Any]:
        from dbidx.spark_integration.api import upsert

        return upsert(df, self.table, key=KEY, partition=PARTITION, cache_config=self.config).to_dict()

    def stop_services(self) -> None:
        """End the table's cache services, if `--cache service=true` started any (they would idle for minutes)."""
        from dbidx.cache.record_cache import RecordIndexCache
        from dbidx.cache.service_link import request_stop

        for shard in range(self.table.num_shards):
            request_stop(RecordIndexCache.for_table(self.table, shard, self.config).path)

    def counts(self) -> tuple[int, int]:
        """(rows, sum of ver) read back from the table's files."""
        data = reads.read_arrow(self.table, columns=["ver"])
        return data.num_rows, int(pc.sum(data.column("ver")).as_py() or 0)


def warm_up(load: Any, scratch: Path, shards: int, settings: dict[str, str]) -> None:
    """Untimed: JVM, shuffle, Parquet writer and Python workers (with dbidx imported) warm for both sides."""
    floor_job(load, shards)
    small = load.limit(WARMUP_ROWS).cache()
    small.count()
    parquet_write(small, scratch / "parquet", shards)
    scratch_table = Dbidx(scratch / "table", scratch / "cache", shards, settings)
    scratch_table.upsert(small)
    scratch_table.stop_services()
    small.unpersist()
    shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class Batch:
    number: int
    rows: int
    dbidx: Measured
    floor_s: float
    work_s: float


@dataclass
class SparkPart:
    load_rows: int
    load: Measured
    load_floor_s: float
    shuffled: Measured
    plain: Measured
    batches: list[Batch]
    counts: tuple[int, int]
    batches_peak: Measured
    work_build_s: float


def spark_part(spark: Any, work: Path, manifest: dict[str, Any], shards: int, settings: dict[str, str]) -> SparkPart:
    """Warm-ups, the write anchors, the dbidx load, the batches with their floors, and the read-back."""
    load, load_rows = cached(spark, manifest["load"])
    log(f"warming up on {load_rows:,} cached rows")
    warm_up(load, work / "speed-warmup", shards, settings)
    shuffled = measured(lambda: parquet_write(load, work / "speed-anchor", shards))
    log(f"Spark write, repartitioned by key: {shuffled.seconds:.2f} s")
    plain = measured(lambda: parquet_write(load, work / "speed-anchor-plain", None))  # no delete of the first
    log(f"Spark write, as it is: {plain.seconds:.2f} s")
    shutil.rmtree(work / "speed-anchor", ignore_errors=True)
    shutil.rmtree(work / "speed-anchor-plain", ignore_errors=True)
    load_floor_s = _report.seconds_of(lambda: floor_job(load, shards))  # one run: ~7 s at 10 M rows
    log(f"Spark floor of the load: {load_floor_s:.2f} s")
    dbidx = Dbidx(work / "speed-table", work / "speed-cache", shards, settings)
    first = measured(lambda: dbidx.upsert(load))
    log(f"dbidx initial load: {first.seconds:.2f} s")
    floor = work_floor.WorkFloor(work / "speed-work-floor", shards)
    work_build_s = floor.build(load)
    log(f"work floor's RocksDBs built (untimed): {work_build_s:.1f} s")
    load.unpersist()
    batches = []
    with Rss() as rss:
        for number, path in enumerate(manifest["batches"], start=1):
            df, rows = cached(spark, path)
            floor_s = floor_seconds(df, shards)
            if number == 1:
                floor.warm(df)
            work_s = floor.seconds(df, FLOOR_REPEATS)
            step = measured(lambda df=df: dbidx.upsert(df))
            batches.append(Batch(number, rows, step, floor_s, work_s))
            df.unpersist()
            log(f"batch {number}: dbidx {step.seconds:.3f} s, Spark floor {floor_s:.3f} s, work floor {work_s:.3f} s")
    dbidx.stop_services()
    counts = dbidx.counts()
    return SparkPart(load_rows, first, load_floor_s, shuffled, plain, batches, counts, peaks(rss), work_build_s)


# ---------------------------------------------------------------------------------------------------------------
# The parts without Spark (restart, lookup) and the optional scale part.


def restart_part(work: Path, keys: int, k: int, commit_keys: int, repeats: int) -> dict[str, Any]:
    """Warm restart vs full re-bootstrap after K commits (restart_bench's measurement)."""
    import numpy as np

    work.mkdir(parents=True)
    try:
        row = restart_bench.warm_vs_full(work, keys, [k], commit_keys, repeats, np.random.default_rng(21))[-1]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "keys": keys,
        "k": k,
        "catchup_entries": row[1],
        "window_entries": row[2],
        "warm_s": row[3],
        "full_s": row[4],
        "ratio": row[4] / row[3],
    }


def lookup_part(work: Path, entries: int, size: int, repeats: int) -> dict[str, Any]:
    """The cache's batched lookup vs raw multi-get on one warm partition (cache_bench's measurement, UUID keys)."""
    work.mkdir(parents=True)
    try:
        table = cache_bench.build_table(work, "uuid", entries, LOOKUP_PARTITIONS)
        parts = [s.partition for s in table.partitions()]
        cache, loaded = cache_bench.load_cache(table, work / "cache", CacheConfig(), parts)
        try:
            row, _ = cache_bench.measure_lookups(table, cache, "uuid", parts[len(parts) // 2], size, repeats)
        finally:
            cache.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"entries": loaded, "batch": row[1], "cache_keys_per_s": row[2], "raw_keys_per_s": row[3], "ratio": row[4]}


def scale_bench_shards() -> int:
    import scale_bench  # beside this script

    return scale_bench.SHARDS


def scale_part(spark: Any, work: Path, sizes: list[int], batch: int) -> dict[str, Any]:
    """Warm tagging s/batch at each size (scale_bench.run_size: build, bootstrap, cold and warm batches)."""
    import scale_bench  # beside this script; imported only when the part runs

    options = argparse.Namespace(batch_rows=batch, repeats=SCALE_REPEATS, join=False)
    work.mkdir(parents=True, exist_ok=True)
    try:
        runs = {keys: scale_bench.run_size(spark, work, keys, options)["warm_s"] for keys in sizes}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, large = min(sizes), max(sizes)
    return {
        "base_keys": base,
        "large_keys": large,
        "base_warm_s": runs[base],
        "large_warm_s": runs[large],
        "ratio": runs[large] / runs[base],
    }


# ---------------------------------------------------------------------------------------------------------------
# The report.


def steady(part: SparkPart) -> tuple[float, float, float]:
    """(dbidx median s, Spark floor median s, work floor median s) over the batches after batch 1."""
    rest = part.batches[1:]
    return (
        statistics.median(b.dbidx.seconds for b in rest),
        statistics.median(b.floor_s for b in rest),
        statistics.median(b.work_s for b in rest),
    )


def steady_mean(part: SparkPart) -> tuple[float, float]:
    """(dbidx mean s, work floor mean s) over the batches after batch 1: the mean carries the batches whose upsert also
    ran the table services after its commit (a data compaction every data_min_small_files batches), which the
    median leaves out; a pipeline pays the mean."""
    rest = part.batches[1:]
    return statistics.fmean(b.dbidx.seconds for b in rest), statistics.fmean(b.work_s for b in rest)


def steady_label(batches: int) -> str:
    return "batch 2" if batches == 2 else f"batches 2-{batches}"


def met(ok: bool) -> str:
    return "yes" if ok else "NO"


def seconds(value: float) -> str:
    return f"{value:,.3f} s"


def mib(value: int) -> str:
    return f"{value / MIB:,.0f} MiB"


def largest(m: Measured) -> str:
    return f"{mib(m.largest)} ({m.largest_role})"


def goal_rows(
    part: SparkPart, restart: dict[str, Any] | None, lookup: dict[str, Any] | None, scale: dict[str, Any] | None
) -> list[list[str]]:
    """The headline table: each figure, its anchor, the ratio, the goal and whether it was met."""
    dbidx_s, floor_s, work_s = steady(part)
    mean_s, work_mean_s = steady_mean(part)
    load, shuffled, plain = part.load, part.shuffled, part.plain
    first = part.batches[0].dbidx.seconds
    label = steady_label(len(part.batches))
    rows = [
        [
            f"steady batch (median of {label})",
            seconds(dbidx_s),
            f"work floor {seconds(work_s)}",
            f"{dbidx_s / work_s:.2f}x",
            "<= 1.3x",
            met(dbidx_s <= 1.3 * work_s),
        ],
        [
            f"steady batch, mean of {label} (with the table services some upserts ran after their commit)",
            seconds(mean_s),
            f"work floor mean {seconds(work_mean_s)}",
            f"{mean_s / work_mean_s:.2f}x",
            "-",
            "-",
        ],
        [
            "steady batch vs the Spark floor (the empty job of its shape)",
            seconds(dbidx_s),
            f"Spark floor {seconds(floor_s)}",
            f"{dbidx_s / floor_s:.2f}x",
            "-",
            "-",
        ],
        [
            f"initial load ({part.load_rows:,} rows, bulk path)",
            seconds(load.seconds),
            f"Spark repartition + write {seconds(shuffled.seconds)}",
            f"{load.seconds / shuffled.seconds:.2f}x",
            "<= 1.3x",
            met(load.seconds <= 1.3 * shuffled.seconds),
        ],
        [
            "initial load vs Spark's plain write",
            seconds(load.seconds),
            f"Spark write {seconds(plain.seconds)}",
            f"{load.seconds / plain.seconds:.2f}x",
            "-",
            "-",
        ],
        [
            "initial load vs its Spark floor (the same shuffle, every row to Python, nothing written)",
            seconds(load.seconds),
            f"Spark floor {seconds(part.load_floor_s)}",
            f"{load.seconds / part.load_floor_s:.2f}x",
            "-",
            "-",
        ],
        [
            "initial load: peak RSS, largest process",
            largest(load),
            f"Spark repartition + write {largest(shuffled)}",
            f"{load.largest / shuffled.largest:.2f}x",
            "<= 2 GB",
            met(load.largest <= LARGEST_GOAL_BYTES),
        ],
        [
            "initial load: peak RSS, largest Python process (driver or worker)",
            mib(load.largest_python),
            f"Spark repartition + write {mib(shuffled.largest_python)}",
            "-",
            "<= 2 GB",
            met(load.largest_python <= LARGEST_GOAL_BYTES),
        ],
        [
            "initial load: peak RSS, process tree",
            mib(load.total),
            f"Spark repartition + write {mib(shuffled.total)}",
            f"{load.total / shuffled.total:.2f}x",
            "-",
            "-",
        ],
        [
            "first batch after the load",
            seconds(first),
            f"steady median {seconds(dbidx_s)}",
            f"{first / dbidx_s:.2f}x",
            "<= 2x",
            met(first <= 2 * dbidx_s),
        ],
    ]
    if restart is not None:
        rows.append(
            [
                f"warm restart, K = {restart['k']} commits ({restart['catchup_entries']:,} entries to catch up), "
                f"{restart['keys']:,} keys",
                seconds(restart["warm_s"]),
                f"full re-bootstrap {seconds(restart['full_s'])}",
                f"{restart['ratio']:.1f}x (full / warm)",
                ">= 20x",
                met(restart["ratio"] >= 20),
            ]
        )
    else:
        rows.append(["warm restart vs re-bootstrap", "skipped (--skip restart)", "-", "-", ">= 20x", "-"])
    if lookup is not None:
        rows.append(
            [
                f"lookup path, {lookup['batch']:,} keys, {lookup['entries']:,} entries",
                f"{lookup['cache_keys_per_s']:,.0f} keys/s",
                f"raw multi-get {lookup['raw_keys_per_s']:,.0f} keys/s",
                f"{lookup['ratio']:.2f}x",
                ">= 0.8x",
                met(lookup["ratio"] >= 0.8),
            ]
        )
    else:
        rows.append(["lookup path vs raw multi-get", "skipped (--skip lookup)", "-", "-", ">= 0.8x", "-"])
    if scale is not None:
        rows.append(
            [
                f"warm tag batch at {scale['large_keys']:,} keys",
                seconds(scale["large_warm_s"]),
                f"at {scale['base_keys']:,} keys {seconds(scale['base_warm_s'])}",
                f"{scale['ratio']:.2f}x",
                "<= 1.2x",
                met(scale["ratio"] <= 1.2),
            ]
        )
    else:
        rows.append(
            ["warm batch at a large size vs a base size", "not run (pass --scale-keys)", "-", "-", "<= 1.2x", "-"]
        )
    return rows


STEP_HEADERS = [
    "step",
    "rows",
    "dbidx s",
    "anchor",
    "anchor s",
    "work floor s",
    "on-demand loads",
    "stall s",
    "staged loads",
    "catch-up entries: task / service ahead",
    "open s (slowest shard)",
    "sync s (slowest)",
    "tag s (slowest)",
    "write s (slowest)",
    "waited for service s (slowest)",
    "key indexes: memory / key files / decoded",
    "hit rate",
    "driver phases s: prepare / job / commit / cleanup / services",
]


def summary_cells(summary: dict[str, Any]) -> list[Any]:
    """The upsert summary's cache figures, as STEP_HEADERS lists them ("-" where the summary has no such key)."""

    def get(name: str, fmt: str = "{:,}") -> str:
        return fmt.format(summary[name]) if name in summary else "-"

    shards = summary.get("per_shard") or []

    def slowest(name: str) -> str:
        return f"{max(s.get(name, 0.0) for s in shards):.3f}" if shards else "-"

    sources = (
        " / ".join(
            f"{sum(s.get('keys_from_' + name, 0) for s in shards):,}" for name in ("memory", "key_files", "data_files")
        )
        if shards
        else "-"
    )
    phases = summary.get("phases") or {}
    return [
        get("on_demand_loads"),
        get("stall_seconds", "{:.2f}"),
        get("staged_loads"),
        f"{get('catchup_entries')} / {sum(s.get('ahead_entries', 0) for s in shards):,}",
        slowest("open_seconds"),
        slowest("sync_seconds"),
        slowest("tag_seconds"),
        slowest("write_seconds"),
        slowest("service_seconds"),
        sources,
        get("hit_rate", "{:.1%}"),
        " / ".join(f"{v:.3f}" for v in phases.values()) if phases else "-",
    ]


def step_rows(part: SparkPart) -> list[list[Any]]:
    load, shuffled, plain = part.load, part.shuffled, part.plain
    none = ["-"] * (len(STEP_HEADERS) - 6)
    rows: list[list[Any]] = [
        ["Spark repartition + write (anchor)", part.load_rows, "-", "-", seconds(shuffled.seconds), "-"] + none,
        ["Spark plain write (anchor)", part.load_rows, "-", "-", seconds(plain.seconds), "-"] + none,
        [
            "dbidx initial load",
            part.load_rows,
            seconds(load.seconds),
            "Spark repartition + write",
            seconds(shuffled.seconds),
            "-",
        ]
        + summary_cells(load.summary),
    ]
    for b in part.batches:
        rows.append(
            [
                f"batch {b.number}",
                b.rows,
                seconds(b.dbidx.seconds),
                f"Spark floor (median of {FLOOR_REPEATS})",
                seconds(b.floor_s),
                seconds(b.work_s),
            ]
            + summary_cells(b.dbidx.summary)
        )
    return rows


def services_rows(part: SparkPart) -> list[list[Any]]:
    """What the table services after each commit did, per batch that ran any (from the upsert summary's `services`):
    the cost the median hides and the mean carries."""
    rows = []
    for b in part.batches:
        report = b.dbidx.summary.get("services") or {}
        for run in report.get("ran") or []:
            details = run.get("details") or {}
            rows.append(
                [
                    f"batch {b.number}",
                    run.get("service", "-"),
                    seconds(run.get("seconds") or 0.0),
                    details.get("ran_on", "-"),
                    ", ".join(f"{k} {_brief(v)}" for k, v in details.items() if k != "ran_on") or "-",
                ]
            )
        if report.get("error"):
            rows.append([f"batch {b.number}", "error", "-", "-", str(report["error"])[:200]])
    return rows


def _brief(value: Any) -> str:
    """A services detail in a table cell: a list of partitions by its length, numbers with separators."""
    if isinstance(value, (list, tuple)):
        return f"{len(value):,}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def memory_rows(part: SparkPart) -> list[list[Any]]:
    steps = [
        ("Spark repartition + write", part.shuffled),
        ("Spark plain write", part.plain),
        ("dbidx initial load", part.load),
        (f"dbidx batches 1-{len(part.batches)} (with their floors)", part.batches_peak),
    ]
    return [[name, mib(m.start_largest), mib(m.start_total), largest(m), mib(m.total)] for name, m in steps]


def check_line(part: SparkPart, manifest: dict[str, Any]) -> tuple[str, bool]:
    (rows, sum_ver), expected = part.counts, (manifest["rows"], manifest["sum_ver"])
    ok = (rows, sum_ver) == expected
    return (
        f"Check (the table read back with `reads.read_arrow`): {rows:,} rows, sum(ver) {sum_ver:,}; "
        f"expected {expected[0]:,} distinct keys, sum(ver) {expected[1]:,}: "
        f"{'check ok' if ok else 'MISMATCH'}."
    ), ok


def figures(
    args: argparse.Namespace,
    part: SparkPart,
    restart: dict[str, Any] | None,
    lookup: dict[str, Any] | None,
    scale: dict[str, Any] | None,
    ok: bool,
) -> dict[str, Any]:
    dbidx_s, floor_s, work_s = steady(part)

    def step(m: Measured) -> dict[str, Any]:
        return {
            "seconds": m.seconds,
            "peak_largest": m.largest,
            "peak_largest_role": m.largest_role,
            "peak_tree": m.total,
            "start_largest": m.start_largest,
            "start_tree": m.start_total,
        }

    return {
        "keys": args.keys,
        "batches": args.batches,
        "batch_rows": args.batch,
        "shards": args.shards,
        "steady_s": dbidx_s,
        "steady_floor_s": floor_s,
        "steady_work_floor_s": work_s,
        "work_floor_build_s": part.work_build_s,
        "load": step(part.load),
        "load_floor_s": part.load_floor_s,
        "spark_shuffled_write": step(part.shuffled),
        "spark_plain_write": step(part.plain),
        "batch_s": [b.dbidx.seconds for b in part.batches],
        "floor_s": [b.floor_s for b in part.batches],
        "work_floor_s": [b.work_s for b in part.batches],
        "on_demand_loads": [b.dbidx.summary.get("on_demand_loads") for b in part.batches],
        "stall_s": [b.dbidx.summary.get("stall_seconds") for b in part.batches],
        "summaries": [
            {k: v for k, v in m.summary.items() if k not in ("partitions", "per_shard", "services")}
            | {"services_s": (m.summary.get("services") or {}).get("seconds")}
            for m in [part.load] + [b.dbidx for b in part.batches]
        ],
        "batches_peak": step(part.batches_peak),
        "restart": restart,
        "lookup": lookup,
        "scale": scale,
        "check_ok": ok,
    }


def render(args: argparse.Namespace, origin: str, part: SparkPart, goals: list[list[str]], check: str) -> str:
    return "\n\n".join(
        [
            f"## Speed at and around the steady state: {args.keys:,} keys",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. Spark local[2], {args.shards} key shards. "
            f"{args.keys:,} UUID keys over 30 daily partitions loaded at once, then {args.batches} change batches of "
            f"{args.batch:,} rows (80% updates of the last 7 days, 5% late updates, 15% new keys; data {origin}). Every "
            f"input is a cached DataFrame. Untimed warm-ups first: a floor job, a {WARMUP_ROWS:,}-row Spark Parquet "
            f"write, a {WARMUP_ROWS:,}-row dbidx upsert into a scratch table. The Spark floor of a batch: "
            f"`repartition({args.shards}, col(id).cast(string)).mapInArrow(read every batch, one row per task)"
            f".collect()` on the same cached DataFrame, median of {FLOOR_REPEATS}, run just before the batch's upsert; "
            f"the work floor of a batch (benchmarks/work_floor.py): the same shuffle, then each task multi-gets its keys, "
            f"sorted, in an open, warm RocksDB of its shard holding the load's keys (built untimed after the load, kept "
            f"open read-only in each Python worker, 256 MiB block cache, bloom filter) and writes one zstd Parquet file "
            f"per partition touched, and the driver writes and fsyncs one commit file listing them; median of "
            f"{FLOOR_REPEATS} after an untimed run, just before the batch's upsert; "
            f"the load's floor is one such job on the load's DataFrame, run just before the dbidx load. "
            f"Steady = median of {steady_label(args.batches)}; batch 1 runs right after the load, on the caches it left. "
            + (f"Cache settings: `{args.cache}` (docs/CONFIG.md). " if args.cache else "")
            + f"Peak RSS: sampled every 0.2 s while the step ran (the JVM keeps the heap earlier steps grew; its size "
            f"follows spark.driver.memory, 4g here, as Spark's own write shows). Restart: "
            f"restart_bench's measurement (one shard, 30 daily partitions, K commits of {args.restart_commit_keys:,} "
            f"entries, medians of {args.restart_repeats}); lookup: cache_bench's (one warm partition of a "
            f"{LOOKUP_PARTITIONS}-partition cache, 80% present keys, medians of {args.lookup_repeats})."
            + (
                f" Scale: scale_bench's measurement (an index of A and of B keys, {scale_bench_shards()} shards, Spark "
                f"`tag` of {args.batch:,}-row batches into the noop sink, median of {SCALE_REPEATS} warm batches)."
                if args.scale_sizes
                else ""
            ),
            _report.table(HEADERS, goals),
            check,
            "Per step (from the upsert's summary: on-demand loads and their stall, partitions ingested from SSTs the "
            "load staged, catch-up entries (in the tasks, and those a cache service applied between batches), the "
            "slowest shard task's cache sync, tagging and writing (data files, deletion vectors, index files), how "
            "long the slowest task waited for its cache service (with `--cache service=true`: rows sent, work, "
            "answer), where the key indexes of the older data files the deletion vectors searched came from (the "
            "worker's memory, the executor's key files, or decoded from the data file), hit rate):",
            _report.table(STEP_HEADERS, step_rows(part)),
            "The table services each upsert ran after its commit (`after_commit`, on by default; docs/CONFIG.md), in "
            "the batches where they did anything (partitions: how many; bytes before and after: of the files "
            "rewritten):",
            _report.table(["step", "service", "seconds", "ran on", "what"], services_rows(part) or [["-"] * 5]),
            "RSS per step, when it began and at its peak (largest single process, and the sum over the process tree: "
            "driver, Spark JVM, Python workers):",
            _report.table(
                ["step", "largest at start", "tree at start", "peak largest", "peak tree"], memory_rows(part)
            ),
        ]
    )


# ---------------------------------------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--batch", type=int, default=100_000, help="rows per change batch")
    parser.add_argument("--shards", type=int, default=2, help="dbidx key shards and Spark shuffle partitions")
    parser.add_argument("--work", type=Path, help="data dir, kept for reuse (default: a temp dir, removed)")
    parser.add_argument("--restart-keys", type=int, default=2_000_000)
    parser.add_argument("--scale-keys", help="two index sizes A,B: warm batch at B vs A (default: not run)")
    parser.add_argument("--skip", default="", help=f"comma separated, of {', '.join(SKIPPABLE)}")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (well under a minute; used by tests)")
    parser.add_argument(
        "--cache",
        default="",
        help=f"{_report.CACHE_HELP} of the dbidx load and batches (an A/B of one setting is two runs)",
    )
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    args.cache_options = _report.cache_settings(parser, args.cache)
    args.restart_k, args.restart_commit_keys, args.restart_repeats = RESTART_K, RESTART_COMMIT_KEYS, RESTART_REPEATS
    args.lookup_repeats = LOOKUP_REPEATS
    if args.smoke:
        global FLOOR_REPEATS
        FLOOR_REPEATS = 1  # a smoke run checks that every step runs, not its figures
        # restart and lookup have their own smoke runs (restart_bench, cache_bench): here only the Spark rows.
        args.keys, args.batches, args.batch, args.restart_keys = 20_000, 2, 2_000, 60_000
        args.restart_k, args.restart_commit_keys, args.restart_repeats, args.lookup_repeats = 2, 1_000, 1, 1
        args.skip = ",".join(filter(None, [args.skip, "restart", "lookup"]))
    if args.batches < 2:
        parser.error("--batches must be at least 2 (the steady median leaves out batch 1)")
    args.skipped = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skipped - set(SKIPPABLE):
        parser.error(f"--skip takes {', '.join(SKIPPABLE)}; got {args.skip!r}")
    args.scale_sizes = sorted(int(s) for s in args.scale_keys.split(",")) if args.scale_keys else None
    if args.scale_sizes is not None and len(set(args.scale_sizes)) != 2:
        parser.error("--scale-keys takes two different sizes, A,B")
    return args


def run(args: argparse.Namespace, work: Path) -> tuple[str, bool, dict[str, Any]]:
    manifest, origin = dataset(work, args.keys, args.batches, args.batch)
    log(f"data {origin}")
    for name in (
        "speed-table",
        "speed-cache",
        "speed-spark",
        "speed-anchor",
        "speed-anchor-plain",
        "speed-warmup",
        "speed-restart",
        "speed-lookup",
        "speed-scale",
        "speed-work-floor",
    ):
        shutil.rmtree(work / name, ignore_errors=True)
    spark = _report.spark_session(work / "speed-spark", args.shards, "dbidx-speed-bench")
    scale = None
    try:
        part = spark_part(spark, work, manifest, args.shards, args.cache_options)
        if args.scale_sizes:
            scale = scale_part(spark, work / "speed-scale", args.scale_sizes, args.batch)
    finally:
        spark.stop()
        for name in ("speed-table", "speed-cache", "speed-spark", "speed-work-floor"):
            shutil.rmtree(work / name, ignore_errors=True)
    restart = lookup = None
    if "restart" not in args.skipped:
        log(f"restart: {args.restart_keys:,} keys, K = {args.restart_k}")
        restart = restart_part(
            work / "speed-restart", args.restart_keys, args.restart_k, args.restart_commit_keys, args.restart_repeats
        )
    if "lookup" not in args.skipped:
        log(f"lookup: {args.keys:,} entries, batches of {args.batch:,}")
        lookup = lookup_part(work / "speed-lookup", args.keys, args.batch, args.lookup_repeats)
    check, ok = check_line(part, manifest)
    body = render(args, origin, part, goal_rows(part, restart, lookup, scale), check)
    return body, ok, figures(args, part, restart, lookup, scale, ok)


def main() -> None:
    args = parse()
    own = args.work is None
    work = Path(tempfile.mkdtemp(prefix="dbidx-speed-bench-", dir=str(Path.cwd()))) if own else args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        body, ok, figs = run(args, work)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    if not ok:  # figures measured on a broken table are not published
        print(body)
        raise SystemExit("the table read back does not match the data written (see the check line)")
    if args.write_results and not args.smoke:
        body = _report.publish(f"speed-{args.keys}", body, figs)  # one section per size, as the peers
    print(body)


if __name__ == "__main__":
    main()
