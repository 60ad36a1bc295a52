"""Bootstrap benchmark: time-bounded bootstrap rate (serial vs threads vs processes), the on-demand stall of one
cold partition, warm restart, and the projection to RFC-107's example (10 M keys/day, a 7-day window).

Data: `--days-total` daily partitions of `--keys-per-day` random UUID keys (default 30 x 300 k), one commit per day,
file groups of ~100 k keys; one shard cache (`--shards 1`) so a load's rate is one executor's. Every figure is
end to end: index Parquet -> ready column families (read, encode, sort, SST write, ingest, registry flip).
Run: `python benchmarks/bootstrap_bench.py [--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

from dbidx.bootstrap.on_demand import OnDemandLoader
from dbidx.bootstrap.time_bounded import bootstrap
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.table.facade import Table

FIRST_DAY = np.datetime64("2025-01-01")


def uuid_keys(n: int, rng: np.random.Generator) -> pa.Array:
    """n random canonical UUID strings, built with numpy (hex of 16 random bytes, dashes inserted)."""
    raw = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    hexed = np.frombuffer(raw.tobytes().hex().encode(), dtype=np.uint8).reshape(n, 32)
    out = np.full((n, 36), ord("-"), dtype=np.uint8)
    out[:, [i for i in range(36) if i not in (8, 13, 18, 23)]] = hexed
    offsets = np.arange(0, 36 * (n + 1), 36, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(out.tobytes())])


def partition_of(day: int) -> str:
    return f"dt={FIRST_DAY + day}"


def build_table(root: Path, days_total: int, keys_per_day: int, shards: int) -> Table:
    """The benchmark table: one commit per daily partition."""
    table = Table.create(str(root / "table"), num_shards=shards)
    rng = np.random.default_rng(7)
    groups = max(1, keys_per_day // 100_000)
    for day in range(days_total):
        keys = uuid_keys(keys_per_day, rng)
        fgs = pa.array([f"{g:08d}-{day:08x}" for g in range(groups)]).take(pa.array(np.arange(keys_per_day) % groups))
        with table.new_commit() as w:
            w.insert(partition_of(day), keys, fgs)
    return table


def timed_bootstrap(table: Table, base: Path, days: int, now: str, parallelism: str) -> tuple[float, int, int, str]:
    """(seconds, entries, disk bytes, mode used) of a cold bootstrap into an empty base path."""
    shutil.rmtree(base, ignore_errors=True)
    result = bootstrap(table, days=days, now=now, base_path=base, parallelism=parallelism)
    return result.seconds, result.entries, result.disk_bytes, result.parallelism


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days-total", type=int, default=30)
    parser.add_argument("--keys-per-day", type=int, default=300_000)
    parser.add_argument("--window", type=int, default=7)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.days_total, args.keys_per_day, args.window, args.repeats = 6, 20_000, 3, 1
    work = Path(tempfile.mkdtemp(prefix="dbidx-bootstrap-bench-", dir=str(Path.cwd())))
    try:
        started = time.perf_counter()
        table = build_table(work, args.days_total, args.keys_per_day, args.shards)
        build_s = time.perf_counter() - started
        now = str(FIRST_DAY + args.days_total - 1)
        index_bytes = _report.dir_bytes(work / "table" / ".dbidx", "*.parquet")
        # 1. Cold bootstrap of the window, per parallelism mode (medians).
        rows, rates = [], {}
        plans = [(mode, args.window) for mode in ("serial", "threads", "processes", "auto")]
        plans += [(mode, args.days_total) for mode in ("serial", "processes", "auto")]  # a big load: the crossover
        runs: dict[tuple[str, int], list[tuple[float, int, int, str]]] = {plan: [] for plan in plans}
        for _ in range(args.repeats):  # interleaved, so a slow moment of the machine hits every mode alike
            for mode, window in plans:
                runs[(mode, window)].append(timed_bootstrap(table, work / "caches", window, now, mode))
        for (mode, window), results in runs.items():
            seconds = sorted(r[0] for r in results)[len(results) // 2]
            entries, disk, used = results[-1][1], results[-1][2], results[-1][3]
            rates[(mode, window)] = entries / seconds
            rows.append(
                [
                    mode if mode != "auto" else f"auto ({used})",
                    window,
                    entries,
                    seconds,
                    entries / seconds,
                    disk / entries,
                ]
            )
        # 2. Warm restart: the caches are intact, 1 new commit since; bootstrap only catches up.
        timed_bootstrap(table, work / "caches", args.window, now, "auto")
        with table.new_commit() as w:
            w.insert(partition_of(args.days_total - 1), uuid_keys(10_000, np.random.default_rng(9)), "99999999-new")
        warm_s, _ = _report.median_time(
            lambda: bootstrap(table, days=args.window, now=now, base_path=work / "caches"), args.repeats
        )
        # 3. On-demand stall: one cold partition (outside the window) needed by a batch.
        cache = RecordIndexCache.for_table(table, 0, CacheConfig(), base_path=work / "caches").open()
        cold = [partition_of(d) for d in range(min(args.repeats, args.days_total - args.window))]
        stalls = []
        with OnDemandLoader(cache, table) as loader:
            for partition in cold:
                stalls.append(loader.ensure_loaded([partition]).stall_seconds)
        cold_entries = cache.partitions()[cold[0]].entries
        cache.close()
        stall = sorted(stalls)[len(stalls) // 2]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    window_rate = max(r for (mode, w), r in rates.items() if w == args.window)
    per_entry = rows[0][5]
    projection = projection_rows(window_rate, per_entry, args.shards)
    body = "\n\n".join(
        [
            "## Bootstrap (time-bounded, on-demand, warm restart)",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. Medians of {args.repeats} run(s). "
            f"Table: {args.days_total} daily partitions x {args.keys_per_day:,} random UUID keys ({build_s:.0f} s to "
            f"write, {index_bytes / (args.days_total * args.keys_per_day):.1f} B/entry of Parquet), "
            f"{args.shards} shard(s); "
            f"bootstrap of the last {args.window} days into empty caches, end to end (index Parquet -> ready column "
            "families).",
            _report.table(["parallelism", "days", "entries", "seconds", "entries/s", "cache B/entry"], rows),
            _report.table(
                ["what", "value"],
                [
                    [f"best rate for the {args.window}-day window, entries/s", window_rate],
                    ["warm restart (intact caches, 1 commit of 10 k keys to catch up), s", warm_s],
                    [f"on-demand stall, one cold partition of {cold_entries:,} entries, s", stall],
                    ["on-demand stall per 1 M entries, s", stall / max(cold_entries, 1) * 1_000_000],
                ],
            ),
            "Projection (RFC-107's example: 10 M new keys/day, a 7-day window = 70 M entries per table, ~4.2 GB in its "
            "estimate; with the best measured window rate and bytes/entry above, each executor loading its own shards, "
            "all executors in parallel; a 70 M single-executor load would run in processes, faster than this rate):",
            _report.table(
                ["executors (shards)", "entries per executor", "disk per executor (GB)", "bootstrap per executor (s)"],
                projection,
            ),
        ]
    )
    if args.write_results and not args.smoke:
        body = _report.publish(
            "bootstrap",
            body,
            {
                "window_entries_per_s": window_rate,
                "days_total": args.days_total,
                "keys_per_day": args.keys_per_day,
                "rows": rows,
                "stall_s_per_million": stall / max(cold_entries, 1) * 1_000_000,
                "cache_bytes_per_entry": per_entry,
            },
        )
    print(body)


def projection_rows(rate: float, bytes_per_entry: float, _shards: int) -> list[list[object]]:
    """70 M entries split over N executors: what each one holds and how long its bootstrap takes."""
    total = 70_000_000
    rows = []
    for executors in (1, 10, 100):
        each = total // executors
        rows.append([executors, each, each * bytes_per_entry / 1e9, each / rate])
    return rows


if __name__ == "__main__":
    main()
