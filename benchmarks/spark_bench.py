"""Spark tagging benchmark: per-batch tagging time with dbidx vs a Spark join against the RLI Parquet files vs a
driver-side Python dict, for index sizes from 1 M to 10 M keys.

Data: a partitioned table with `--shards` key shards, keys `user-<9 digits>` spread over 30 daily partitions, one
bucket file group per (partition, shard) as upsert writes them. Batches: `--batch-rows` rows, 80% existing keys
(random, all partitions) and 20% new keys, cached in Spark memory before timing, so every method reads the same
rows (a throwaway 50 k-key round first warms the JVM and the Python workers). Per size: a first batch (dbidx loads the
shard caches on demand: reported as "cold first batch") and a second warm-up run, then `--repeats` timed batches per
method (median). Forced with Spark's `noop` sink.
  dbidx: `tag(batch, table)`; the join: `batch LEFT JOIN rli ON key` over the RLI Parquet files the index lists
  (what a user does without dbidx); dict: the batch collected to the driver as Arrow, then dict lookups.
Run: `python benchmarks/spark_bench.py [--sizes 1000000,3000000,10000000] [--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

from dbidx.buckets.naming import file_group_id
from dbidx.config import CacheConfig
from dbidx.index import rli_files
from dbidx.table.facade import Table

PARTITIONS = 30


def key_strings(ids: np.ndarray) -> pa.Array:
    return pa.array(np.char.add("user-", np.char.zfill(ids.astype(str), 9)).tolist(), pa.string())


def day_of(ids: np.ndarray) -> np.ndarray:
    return ids % PARTITIONS


def build_index(root: Path, keys: int, shards: int) -> Table:
    """The RLI of `keys` keys: one commit per partition, file group = the (partition, shard) bucket."""
    table = Table.create(str(root / f"table-{keys}"), num_shards=shards)
    ids = np.arange(keys)
    for p in range(PARTITIONS):
        part = f"dt=2025-01-{p + 1:02d}"
        k = key_strings(ids[day_of(ids) == p])
        names = np.array([file_group_id(table.props.table_id, part, s) for s in range(shards)], dtype=object)
        with table.new_commit() as writer:
            writer.insert(part, k, pa.array(names[table.shard_of(k)].tolist(), pa.string()))
    return table


def make_batch(spark, keys: int, rows: int, rng: np.random.Generator, serial: list[int]):
    """80% existing keys, 20% new ones; cached and counted so the timing sees only the tagging."""
    existing = rng.choice(keys, int(rows * 0.8), replace=False)
    new = np.arange(serial[0], serial[0] + rows - len(existing))
    serial[0] += len(new)
    ids = np.concatenate([existing, new])
    frame = pa.table(
        {
            "id": key_strings(ids),
            "dt": pa.array([f"2025-01-{d + 1:02d}" for d in day_of(ids)], pa.string()),
            "amount": pa.array(rng.random(len(ids))),
        }
    ).to_pandas()
    df = spark.createDataFrame(frame).cache()
    df.count()
    return df


def run_size(spark, work: Path, keys: int, args: argparse.Namespace) -> dict:
    from pyspark.sql import functions as F

    from dbidx.spark_integration.api import tag

    rng = np.random.default_rng(keys)
    started = time.perf_counter()
    table = build_index(work, keys, args.shards)
    build_s = time.perf_counter() - started
    config = CacheConfig(base_path=str(work / f"cache-{keys}"))
    serial = [10**9 - 10**8]
    noop = lambda df: df.write.format("noop").mode("overwrite").save()  # noqa: E731
    # 1. dbidx: the first batch loads the shard caches on demand (the cold cost); a second one warms the Python
    #    workers (imports, the worker's Table); then the steady-state batches are timed.
    first = make_batch(spark, keys, args.batch_rows, rng, serial)
    cold_s = _report.seconds_of(lambda: noop(tag(first, table, key="id", partition="dt", cache_config=config)))
    noop(tag(first, table, key="id", partition="dt", cache_config=config))
    batches = [make_batch(spark, keys, args.batch_rows, rng, serial) for _ in range(args.repeats)]
    dbidx_s = statistics.median(
        _report.seconds_of(lambda b=b: noop(tag(b, table, key="id", partition="dt", cache_config=config)))
        for b in batches
    )
    found = (
        tag(batches[0], table, key="id", partition="dt", cache_config=config).filter(F.col("_dbidx_is_update")).count()
    )
    # 2. The join a user writes without dbidx: the batch against every live RLI entry, read from Parquet.
    paths = _report.rli_paths(table)

    def join(batch):
        rli = (
            spark.read.option("recursiveFileLookup", "true")
            .parquet(*paths)
            .filter(~F.col(rli_files.DELETED))
            .select(rli_files.KEY, rli_files.FILE_GROUP)
        )
        return batch.join(rli, batch.id == rli[rli_files.KEY], "left").withColumn(
            "is_update", F.col(rli_files.FILE_GROUP).isNotNull()
        )

    join_s = statistics.median(_report.seconds_of(lambda b=b: noop(join(b))) for b in batches)
    join_found = join(batches[0]).filter("is_update").count()
    # 3. A driver-side dict of the whole index (built once, untimed per batch), the batch collected to it.
    rss0 = _report.rss_bytes()
    started = time.perf_counter()
    index: dict[str, str] = {}
    for path in paths:
        part = pq.read_table(path, columns=[rli_files.KEY, rli_files.FILE_GROUP])
        index.update(zip(part.column(0).to_pylist(), part.column(1).to_pylist()))
    dict_build_s = time.perf_counter() - started
    dict_mb = (_report.rss_bytes() - rss0) / (1 << 20)

    def by_dict(batch) -> int:
        ids = batch.select("id").toArrow().column(0).to_pylist()
        get = index.get
        return sum(get(k) is not None for k in ids)

    dict_s = statistics.median(_report.seconds_of(lambda b=b: by_dict(b)) for b in batches)
    dict_found = by_dict(batches[0])
    index.clear()  # free the memory before the next size
    for b in [first] + batches:
        b.unpersist()
    if not found == join_found == dict_found == int(args.batch_rows * 0.8):
        raise SystemExit(f"methods disagree at {keys:,} keys: dbidx {found}, join {join_found}, dict {dict_found}")
    shutil.rmtree(work / f"table-{keys}", ignore_errors=True)
    shutil.rmtree(work / f"cache-{keys}", ignore_errors=True)
    return {
        "keys": keys,
        "build_s": build_s,
        "cold_s": cold_s,
        "dbidx_s": dbidx_s,
        "join_s": join_s,
        "dict_s": dict_s,
        "dict_build_s": dict_build_s,
        "dict_mb": dict_mb,
    }


def spark_session(work: Path, shards: int):
    return _report.spark_session(work / "spark", shards, "dbidx-spark-bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,3000000,10000000", help="index sizes (keys), comma separated")
    parser.add_argument("--batch-rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per method and size (median)")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one batch (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.batch_rows, args.repeats = "20000", 2_000, 1
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dbidx-spark-bench-"))
    spark = spark_session(work, args.shards)
    try:
        if not args.smoke:  # JVM and Python-worker warm-up, so the first size does not pay for it
            run_size(spark, work, 50_000, argparse.Namespace(**{**vars(args), "batch_rows": 5_000, "repeats": 1}))
        results = []
        for keys in sizes:
            results.append(run_size(spark, work, keys, args))
            r = results[-1]
            print(
                f"{keys:,} keys: dbidx {r['dbidx_s']:.2f} s, join {r['join_s']:.2f} s, dict {r['dict_s']:.2f} s",
                file=sys.stderr,
            )
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [
            r["keys"],
            r["dbidx_s"],
            r["join_s"],
            r["dict_s"],
            f"{r['join_s'] / r['dbidx_s']:.1f}x",
            r["cold_s"],
            r["dict_build_s"],
            round(r["dict_mb"]),
        ]
        for r in results
    ]
    largest = results[-1]
    ratio = largest["join_s"] / largest["dbidx_s"]
    verdict = (
        f"At {largest['keys']:,} keys dbidx tags a {args.batch_rows:,}-row batch {ratio:.1f}x faster than the "
        f"join (target >= 10x: {'met' if ratio >= 10 else 'NOT met'})."
    )
    body = "\n\n".join(
        [
            "## Spark tagging",
            f"Machine: {_report.machine()}; Spark local[2], {args.shards} key shards. Command: `{_report.command()}`. "
            f"Batches of {args.batch_rows:,} rows (80% existing keys over 30 daily partitions, 20% new), median of "
            f"{args.repeats} per method; 'cold first batch' is dbidx's warm-up batch, which loads the shard caches on "
            "demand; the dict is built once on the driver (time and RSS growth shown), its per-batch time includes "
            "collecting the batch's keys to the driver.",
            _report.table(
                [
                    "index keys",
                    "dbidx s/batch",
                    "Spark join s/batch",
                    "driver dict s/batch",
                    "join / dbidx",
                    "dbidx cold first batch s",
                    "dict build s",
                    "dict RSS MB",
                ],
                rows,
            ),
            verdict,
        ]
    )
    if args.write_results and not args.smoke:
        body = _report.publish("spark", body, {"batch_rows": args.batch_rows, "shards": args.shards, "sizes": results})
    print(body)


if __name__ == "__main__":
    main()
