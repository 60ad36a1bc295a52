"""Scale benchmark: dbidx's curve on one machine up to 100 M UUID keys (index build, bootstrap, Spark tagging).

What is measured, per index size N (`--sizes`, default 10 M and 100 M, so that with spark_bench's 1 M - 10 M figures
the curve runs from 1 M to 100 M keys):
  1. Build: the persisted index of N random UUID keys over 30 daily partitions, 2 key shards, written the
     cheapest way the library allows (one `new_commit()` + `insert` per partition of N/30 keys, file group = the
     (partition, shard) bucket as upsert names it); seconds, Parquet bytes on disk and per entry, the driver's peak
     RSS while building (keys are generated per partition, so memory is bounded by one partition).
  2. Bootstrap of ONE shard's cache into an empty cache dir (`bootstrap.time_bounded.bootstrap`, parallelism
     "auto", as bootstrap_bench): all 30 partitions, then the 7-day window; seconds, entries/s, cache bytes on disk
     and per entry. One run each.
  3. Spark tagging (`spark_integration.api.tag`, local[2], one SparkSession for the whole run, forced with the
     `noop` sink) of `--batch-rows`-row batches: 80 % existing keys from the last 7 days, 5 % existing keys from
     the 23 older days, 15 % new keys (today's partition). A cold first batch (empty caches: every partition the
     batch touches loads on demand, i.e. both shards' whole index) is reported apart; then a warm-up batch, then
     `--repeats` timed batches (median). Existing keys are sampled while building (a small Arrow pool per
     partition), never held as 100 M Python strings; there is no driver dict (it would need ~17 GB at 100 M);
     the Spark join against the RLI Parquet files runs only with `--join`.
Peak RSS of the whole process tree (driver, Spark's JVM and Python workers, bootstrap processes) is sampled during
steps 2 and 3, so a size's RAM need can be read off a smaller run.
Run: `python benchmarks/scale_bench.py [--sizes 10000000,100000000] [--batch-rows 100000] [--repeats 3] [--join]
[--smoke] [--write-results]` (or `make bench-scale`).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from bootstrap_bench import FIRST_DAY, partition_of, uuid_keys

from dbidx.bootstrap.time_bounded import bootstrap
from dbidx.buckets.naming import file_group_id
from dbidx.config import CacheConfig
from dbidx.index import rli_files
from dbidx.table.facade import Table

PARTITIONS = 30
WINDOW = 7
SHARDS = 2
RECENT, OLDER = 0.80, 0.05  # shares of a batch: existing keys of the last 7 days, of the older days; the rest is new
# A guard, not a figure: disk a size may need at most (index ~20 B/entry, two full shard-cache sets ~18 B/entry each,
# SST staging), so a run stops before it fills a shared disk.
DISK_GUARD_BYTES_PER_KEY = 90


def reset_peak_rss() -> None:
    """Reset this process's VmHWM so the next peak is one step's (left as it is where the kernel refuses)."""
    try:
        _report.reset_peak_rss()
    except OSError:
        pass


def day_label(day: int) -> str:
    """The `dt` column value of a day (its partition path is partition_of(day) = `dt=<label>`)."""
    return str(FIRST_DAY + day)


def keys_in(day: int, keys: int) -> int:
    """Keys of one daily partition: N/30, the remainder spread over the first days (exactly N in all)."""
    return keys // PARTITIONS + (1 if day < keys % PARTITIONS else 0)


def pool_sizes(keys: int, batch_rows: int, batches: int) -> list[int]:
    """Existing keys to keep per partition: enough for `batches` batches that share no key, where the partitions
    hold that many."""
    recent = math.ceil(int(batch_rows * RECENT) * batches / WINDOW)
    older = math.ceil(int(batch_rows * OLDER) * batches / (PARTITIONS - WINDOW))
    return [min(keys_in(d, keys), recent if d >= PARTITIONS - WINDOW else older) for d in range(PARTITIONS)]


def build_index(root: Path, keys: int, pools: list[int], seed: int) -> tuple[Table, list[pa.Array]]:
    """The index of `keys` random UUID keys: one commit per daily partition, file group = the (partition, shard)
    bucket as upsert names it. Returns the table and, per partition, a random sample of its keys (the batches'
    existing keys), so no more than one partition's keys are ever in memory."""
    table = Table.create(str(root / "table"), num_shards=SHARDS)
    generate, pick = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    samples = []
    for day in range(PARTITIONS):
        n = keys_in(day, keys)
        partition = partition_of(day)
        part_keys = uuid_keys(n, generate)
        names = pa.array([file_group_id(table.props.table_id, partition, s) for s in range(SHARDS)], pa.string())
        file_groups = names.take(pa.array(table.shard_of(part_keys)))
        with table.new_commit() as writer:
            writer.insert(partition, part_keys, file_groups)
        samples.append(part_keys.take(pa.array(np.sort(pick.choice(n, pools[day], replace=False)))))
        del part_keys, file_groups
    return table, samples


def bootstrap_one_shard(table: Table, base: Path, days: int) -> dict[str, Any]:
    """A cold bootstrap of shard 0's cache for the last `days` days into an empty base path (then removed)."""
    shutil.rmtree(base, ignore_errors=True)
    with _report.TreeRss() as rss:
        result = bootstrap(
            table, days=days, shards=[0], now=day_label(PARTITIONS - 1), base_path=base, parallelism="auto"
        )
    shutil.rmtree(base, ignore_errors=True)
    return {
        "days": days,
        "seconds": result.seconds,
        "entries": result.entries,
        "entries_per_s": result.entries_per_second,
        "disk_bytes": result.disk_bytes,
        "bytes_per_entry": result.disk_bytes / max(result.entries, 1),
        "parallelism": result.parallelism,
        "peak_tree_rss": rss.total,
    }


class Batches:
    """Tagging batches drawn from the per-partition samples: batch i takes the i-th slice of the shuffled recent
    and older pools, so no two batches share a key (a warm batch must not find its blocks cached by an earlier
    one); where a pool is too small for that (1 M keys: 7 x 33 k recent keys < 5 x 80 k), each batch draws its
    keys at random from the whole pool instead. Keys are distinct within a batch; new keys go to today's
    partition."""

    def __init__(self, samples: list[pa.Array], batch_rows: int, batches: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.batches, self.made = batches, 0
        self.rows = batch_rows
        self.n_recent, self.n_older = int(batch_rows * RECENT), int(batch_rows * OLDER)
        self.n_new = batch_rows - self.n_recent - self.n_older
        self.recent = self._pool(samples, range(PARTITIONS - WINDOW, PARTITIONS))
        self.older = self._pool(samples, range(PARTITIONS - WINDOW))
        if len(self.recent[0]) < self.n_recent or len(self.older[0]) < self.n_older:
            raise SystemExit(f"the index is too small for batches of {batch_rows:,} distinct rows")

    def _pool(self, samples: list[pa.Array], days: range) -> tuple[pa.Array, np.ndarray]:
        keys = pa.concat_arrays([samples[d] for d in days])
        day_of = np.concatenate([np.full(len(samples[d]), d, dtype=np.int32) for d in days])
        order = self.rng.permutation(len(keys))
        return keys.take(pa.array(order)), day_of[order]

    def _draw(self, pool_size: int, n: int) -> np.ndarray:
        """Positions in a pool of the next batch's n keys: its own slice if the pool has room for every batch."""
        if pool_size >= n * self.batches and self.made < self.batches:
            return np.arange(self.made * n, (self.made + 1) * n)
        return self.rng.choice(pool_size, n, replace=False)

    @property
    def existing(self) -> int:
        """Existing keys per batch (what tag must find)."""
        return self.n_recent + self.n_older

    def table(self) -> pa.Table:
        """The next batch: id (key), dt (day), amount; rows shuffled."""
        parts_keys, parts_days = [], []
        for (keys, days), n in ((self.recent, self.n_recent), (self.older, self.n_older)):
            chosen = self._draw(len(keys), n)
            parts_keys.append(keys.take(pa.array(chosen)))
            parts_days.append(days[chosen])
        parts_keys.append(uuid_keys(self.n_new, self.rng))
        parts_days.append(np.full(self.n_new, PARTITIONS - 1, dtype=np.int32))
        labels = pa.array([day_label(d) for d in range(PARTITIONS)], pa.string())
        order = pa.array(self.rng.permutation(self.rows))
        self.made += 1
        return pa.table(
            {
                "id": pa.concat_arrays(parts_keys),
                "dt": labels.take(pa.array(np.concatenate(parts_days))),
                "amount": pa.array(self.rng.random(self.rows)),
            }
        ).take(order)


def spark_batch(spark: Any, batch: pa.Table) -> Any:
    """The batch as a DataFrame cached in Spark memory (counted), so timings see only the tagging."""
    df = spark.createDataFrame(batch.to_pandas()).cache()
    df.count()
    return df


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_size(spark: Any, work: Path, keys: int, args: argparse.Namespace) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from dbidx.spark_integration.api import tag

    root = work / f"size-{keys}"
    batches_needed = 2 + args.repeats  # cold, warm-up, timed
    need = keys * DISK_GUARD_BYTES_PER_KEY
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(
            f"{keys:,} keys may need up to {need / 1e9:.1f} GB of disk under {work}; {free / 1e9:.1f} GB free"
        )
    # 1. Build the index, one commit per daily partition; keep a small sample of each partition's keys.
    reset_peak_rss()
    started = time.perf_counter()
    table, samples = build_index(root, keys, pool_sizes(keys, args.batch_rows, batches_needed), seed=keys % 2**31)
    build_s = time.perf_counter() - started
    build_rss = _report.status_bytes("VmHWM")
    index_bytes = _report.dir_bytes(root / "table" / ".dbidx", "*.parquet")
    log(
        f"{keys:,} keys: built in {build_s:.1f} s, index {index_bytes / 1e9:.2f} GB, driver peak RSS "
        f"{build_rss / 2**30:.2f} GB"
    )
    # 2. Bootstrap one shard's cache: every partition, then the 7-day window (empty cache dir each time).
    full = bootstrap_one_shard(table, root / "boot", PARTITIONS)
    window = bootstrap_one_shard(table, root / "boot", WINDOW)
    log(
        f"{keys:,} keys: one-shard bootstrap, 30 days {full['seconds']:.1f} s ({full['entries_per_s']:,.0f}/s, "
        f"{full['parallelism']}), 7 days {window['seconds']:.1f} s"
    )
    # 3. Spark tagging: cold first batch (on-demand loads), a warm-up batch, then the timed batches.
    config = CacheConfig.from_sources({**args.cache_options, "base_path": str(root / "cache")})
    plan = Batches(samples, args.batch_rows, batches_needed, seed=keys % 2**31 + 2)
    del samples
    frames = [spark_batch(spark, plan.table()) for _ in range(batches_needed)]

    def tagged(df: Any) -> Any:
        return tag(df, table, key="id", partition="dt", cache_config=config)

    def noop(df: Any) -> None:
        df.write.format("noop").mode("overwrite").save()

    with _report.TreeRss() as tag_rss:
        cold_s = _report.seconds_of(lambda: noop(tagged(frames[0])))
        noop(tagged(frames[1]))
        timed = [_report.seconds_of(lambda b=b: noop(tagged(b))) for b in frames[2:]]
    warm_s = statistics.median(timed)
    found = tagged(frames[2]).filter(F.col("_dbidx_is_update")).count()
    if config.service:  # with `--cache service=true` the tag tasks ran in the shards' services: done with this size
        from dbidx.cache.record_cache import RecordIndexCache
        from dbidx.cache.service_link import request_stop

        for shard in range(table.num_shards):
            request_stop(RecordIndexCache.for_table(table, shard, config).path)
    if found != plan.existing:
        raise SystemExit(f"dbidx found {found:,} existing keys in a batch at {keys:,} keys, expected {plan.existing:,}")
    cache_bytes = _report.dir_bytes(root / "cache")
    log(
        f"{keys:,} keys: cold first batch {cold_s:.2f} s, warm {warm_s:.3f} s/batch, tag caches "
        f"{cache_bytes / 1e9:.2f} GB"
    )
    # 4. Optionally, the Spark join a user writes without dbidx: the batch against every live RLI entry.
    join_s = None
    if args.join:
        paths = _report.rli_paths(table)

        def join(batch: Any) -> Any:
            rli = (
                spark.read.option("recursiveFileLookup", "true")
                .parquet(*paths)
                .filter(~F.col(rli_files.DELETED))
                .select(rli_files.KEY, rli_files.FILE_GROUP)
            )
            return batch.join(rli, batch.id == rli[rli_files.KEY], "left").withColumn(
                "is_update", F.col(rli_files.FILE_GROUP).isNotNull()
            )

        join_s = statistics.median(_report.seconds_of(lambda b=b: noop(join(b))) for b in frames[2:])
        join_found = join(frames[2]).filter("is_update").count()
        if join_found != plan.existing:
            raise SystemExit(
                f"the join found {join_found:,} existing keys at {keys:,} keys, expected {plan.existing:,}"
            )
        log(f"{keys:,} keys: Spark join {join_s:.2f} s/batch")
    for frame in frames:
        frame.unpersist()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "keys": keys,
        "build_s": build_s,
        "build_peak_rss": build_rss,
        "index_bytes": index_bytes,
        "index_bytes_per_entry": index_bytes / keys,
        "full_bootstrap": full,
        "window_bootstrap": window,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "warm_runs": timed,
        "tag_cache_bytes": cache_bytes,
        "tag_cache_bytes_per_entry": cache_bytes / keys,
        "tag_peak_tree_rss": tag_rss.total,
        "join_s": join_s,
    }


def verdict(results: list[dict[str, Any]], batch_rows: int) -> tuple[str, float | None]:
    """Warm s/batch at the largest vs the smallest size: flat if within 1.5x."""
    small, large = min(results, key=lambda r: r["keys"]), max(results, key=lambda r: r["keys"])
    if small["keys"] == large["keys"]:
        return f"One size measured ({large['keys']:,} keys): no curve to judge.", None
    ratio = large["warm_s"] / small["warm_s"]
    return (
        f"Warm s/batch ({batch_rows:,} rows) at {large['keys']:,} keys is {ratio:.2f}x that at "
        f"{small['keys']:,} keys ({large['warm_s']:.3f} vs {small['warm_s']:.3f} s): "
        f"{'flat' if ratio <= 1.5 else 'NOT flat'} (flat = within 1.5x)."
    ), ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000000,100000000", help="index sizes (keys), comma separated")
    parser.add_argument("--batch-rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3, help="timed warm batches per size (median)")
    parser.add_argument("--join", action="store_true", help="also time the Spark join against the RLI files")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one batch (seconds; used by tests)")
    parser.add_argument("--cache", default="", help=f"{_report.CACHE_HELP} of the tagging")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    args.cache_options = _report.cache_settings(parser, args.cache)
    if args.smoke:
        args.sizes, args.batch_rows, args.repeats = "30000,60000", 2_000, 1
    sizes = sorted(int(s) for s in args.sizes.split(","))
    work = Path(tempfile.mkdtemp(prefix="dbidx-scale-bench-", dir=str(Path.cwd())))
    spark = _report.spark_session(work / "spark", SHARDS, "dbidx-scale-bench")
    results = []
    try:
        if not args.smoke:  # JVM and Python-worker warm-up, so the first size does not pay for it
            run_size(spark, work, 60_000, argparse.Namespace(**{**vars(args), "batch_rows": 5_000, "repeats": 1}))
        for keys in sizes:
            results.append(run_size(spark, work, keys, args))
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    # 5. The tables and the verdict.
    headers = [
        "index keys",
        "index B/entry",
        "build s",
        "cache B/entry",
        "full bootstrap s (1 shard, 30 days)",
        "full bootstrap entries/s",
        "7-day bootstrap s",
        "cold first batch s",
        "warm s/batch",
    ]
    rows = []
    for r in results:
        full, window = r["full_bootstrap"], r["window_bootstrap"]
        rows.append(
            [
                r["keys"],
                r["index_bytes_per_entry"],
                r["build_s"],
                full["bytes_per_entry"],
                full["seconds"],
                full["entries_per_s"],
                window["seconds"],
                r["cold_s"],
                r["warm_s"],
            ]
            + ([r["join_s"]] if args.join else [])
        )
    if args.join:
        headers.append("Spark join s/batch")
    details = [
        [
            r["keys"],
            r["index_bytes"] / 1e9,
            r["build_peak_rss"] / 2**30,
            r["full_bootstrap"]["entries"],
            r["full_bootstrap"]["parallelism"],
            r["full_bootstrap"]["disk_bytes"] / 1e9,
            r["window_bootstrap"]["entries"],
            r["window_bootstrap"]["entries_per_s"],
            max(r["full_bootstrap"]["peak_tree_rss"], r["window_bootstrap"]["peak_tree_rss"]) / 2**30,
            r["tag_cache_bytes"] / 1e9,
            r["tag_peak_tree_rss"] / 2**30,
        ]
        for r in results
    ]
    line, ratio = verdict(results, args.batch_rows)
    body = "\n\n".join(
        [
            "## Scale on one machine",
            f"Machine: {_report.machine()}; Spark local[2], {SHARDS} key shards. Command: `{_report.command()}`. "
            f"Per size: the index of N random UUID keys over {PARTITIONS} daily partitions (one commit per partition, "
            f"file group = the (partition, shard) bucket); one run of each bootstrap of ONE shard's cache into an "
            f"empty directory (parallelism auto); batches of {args.batch_rows:,} rows ({RECENT:.0%} existing keys of "
            f"the last {WINDOW} days, {OLDER:.0%} of older days, the rest new), 'cold first batch' on empty caches "
            f"(every partition it touches loads on demand, both shards), then a warm-up batch and the median of "
            f"{args.repeats} warm batches. Cache B/entry: the 30-day one-shard bootstrap's directory.",
            _report.table(headers, rows),
            "Sizes on disk and memory (peak RSS: the driver while building; the whole process tree, driver + Spark "
            "JVM + Python workers + bootstrap processes, sampled every 0.25 s, during the bootstraps and the tagging):",
            _report.table(
                [
                    "index keys",
                    "index GB",
                    "build peak RSS GB",
                    "full bootstrap entries",
                    "mode",
                    "full bootstrap cache GB",
                    "7-day entries",
                    "7-day entries/s",
                    "bootstrap peak RSS GB",
                    "tag caches GB (both shards)",
                    "tagging peak RSS GB",
                ],
                details,
            ),
            line,
        ]
    )
    if args.write_results and not args.smoke:
        body = _report.publish(
            "scale",
            body,
            {
                "batch_rows": args.batch_rows,
                "shards": SHARDS,
                "partitions": PARTITIONS,
                "window_days": WINDOW,
                "repeats": args.repeats,
                "sizes": results,
                "verdict": line,
                "warm_ratio": ratio,
            },
        )
    print(body)


if __name__ == "__main__":
    main()
