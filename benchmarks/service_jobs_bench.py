"""Table services in the driver vs as Spark jobs: the same data compaction and index compaction, once in this process
on a few threads (`IN_PROCESS`, what `upsert_arrow` and `dbidx maintain` do, and a Spark writer with
`spark_jobs=false`) and once as one Spark job per compaction (`SparkWorkRunner`, a Spark writer's default), its
pieces packed into as many tasks as Spark has cores.

How: the speed benchmark's data set (UUID keys over 30 daily partitions; change batches of 80 % updates of the last 7
days, 5 % late updates, 15 % new keys) is loaded with `upsert_arrow` and changed by `--batches` batches with the
services off, so every touched file group holds one small file per batch. The table is then copied; the driver
compacts one copy, Spark the other, each timed by wall clock and by the driver process's CPU, best of `--repeats`
fresh copies. A trivial Spark job with as many tasks as pieces gives Spark's scheduling cost beside them. Both
copies must read back the same rows (count and sum of ver) or the script fails.

    python benchmarks/service_jobs_bench.py --keys 1000000 --batches 10 --batch 10000 --write-results
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
import speed_bench

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.table.service_settings import write_settings
from dbidx.table.facade import Table
from dbidx.runner import IN_PROCESS, WorkRunner, pack
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.service_jobs import SparkWorkRunner

SECTION = "service-jobs"
KEY, PARTITION = "id", "dt"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build(work: Path, manifest: dict[str, Any], shards: int) -> Path:
    """The table: the load, then every change batch, services off (each touched file group gets a small file)."""
    root = work / "table"
    table = Table.create(str(root), num_shards=shards)
    write_settings(table.io, {"after_commit": False})
    config = CacheConfig(base_path=str(work / "cache"))
    for path in [manifest["load"], *manifest["batches"]]:
        upsert_arrow(pq.read_table(path), table, key=KEY, partition=PARTITION, cache_config=config)
    return root


@dataclass
class Timed:
    """One compaction run: wall and driver-CPU seconds, pieces, and what it read."""

    wall: float
    cpu: float
    pieces: int
    input_mib: float


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def compact_both(table: Table, runner: WorkRunner) -> tuple[Timed, Timed]:
    """Data compaction of every file group with 2+ small files, then index compaction of every group with 2+ files,
    through `runner`."""
    wall, cpu, data = timed(lambda: table.compact_data(min_files=2, runner=runner))
    first = Timed(wall, cpu, data.file_groups, data.bytes_before / (1 << 20))
    index_bytes = sum(f.size for p, s in table.refresh().groups() for f in table.refresh().files(p, s))
    wall, cpu, index = timed(lambda: table.compact(min_files=2, runner=runner))
    return first, Timed(wall, cpu, index.groups, index_bytes / (1 << 20))


def fingerprint(table: Table) -> tuple[int, int]:
    data = reads.read_arrow(table, columns=[KEY, "ver"])
    return data.num_rows, pc.sum(data.column("ver")).as_py() or 0


def empty_piece(item: int, attempt: int) -> bytes:
    return pack({"item": item})


def scheduling(runner: SparkWorkRunner, pieces: int) -> float:
    """Seconds of a Spark job of `pieces` tasks that do nothing: what one compaction pays Spark to run at all."""
    wall, _, _ = timed(lambda: list(runner.run(empty_piece, list(range(pieces)), "scheduling probe")))
    return wall


def run(args: argparse.Namespace, work: Path) -> tuple[str, bool]:
    manifest, origin = speed_bench.dataset(work, args.keys, args.batches, args.batch)
    log(f"data set: {origin}")
    source = build(work / "built", manifest, args.shards)
    spark = _report.spark_session(work / "spark-local", args.shards, "dbidx-service-jobs-bench")
    spark_runner = SparkWorkRunner(spark)
    scheduling(spark_runner, 2)  # warm: the first job starts the Python workers
    best: dict[str, tuple[Timed, Timed]] = {}
    prints: dict[str, tuple[int, int]] = {}
    for repeat in range(args.repeats):
        for name, runner in (("driver", IN_PROCESS), ("spark", spark_runner)):
            copy = work / f"copy-{name}-{repeat}"
            shutil.copytree(source, copy)
            table = Table.open(str(copy))
            data, index = compact_both(table, runner)
            log(f"{name} repeat {repeat + 1}: data {data.wall:.2f} s, index {index.wall:.2f} s")
            prints[name] = fingerprint(Table.open(str(copy)))
            old = best.get(name)
            best[name] = (
                min(data, old[0], key=lambda t: t.wall) if old else data,
                min(index, old[1], key=lambda t: t.wall) if old else index,
            )
            shutil.rmtree(copy)
    pieces = max(max(best["spark"][0].pieces, best["spark"][1].pieces), 1)
    probe = pieces, min(scheduling(spark_runner, pieces) for _ in range(3))
    spark.stop()
    ok = prints["driver"] == prints["spark"]
    rows = []
    for i, service in enumerate(("data compaction", "index compaction")):
        d, s = best["driver"][i], best["spark"][i]
        rows.append(
            [
                service,
                f"{d.pieces:,}",
                f"{d.input_mib:.1f}",
                f"{d.wall:.2f}",
                f"{s.wall:.2f}",
                f"{s.wall / d.wall:.2f}x" if d.wall else "-",
                f"{d.cpu:.2f}",
                f"{s.cpu:.2f}",
            ]
        )
    body = "\n\n".join(
        [
            f"## Table services in the driver vs as Spark jobs: {args.keys:,} keys, {args.batches} batches of "
            f"{args.batch:,} rows",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. Spark local[2]. Data set {origin}; table "
            f"built with `upsert_arrow`, services off, {args.shards} key shards. Each figure is the best of "
            f"{args.repeats} runs on a fresh copy of the table. Driver: the pieces on a few threads of this process "
            f"(`IN_PROCESS`); Spark: one job per compaction, its pieces packed into as many tasks as Spark has cores, "
            f"balanced by bytes (`SparkWorkRunner`). CPU: this "
            f"(driver) process only; Spark's tasks run in its Python workers. A Spark job of {probe[0]:,} empty pieces "
            f"took {probe[1]:.2f} s (Spark's cost of running a compaction at all).",
            _report.table(
                [
                    "service",
                    "pieces",
                    "input MiB",
                    "driver s",
                    "Spark job s",
                    "Spark / driver",
                    "driver CPU s (driver)",
                    "driver CPU s (Spark)",
                ],
                rows,
            ),
            f"Check: both copies read back {prints['driver'][0]:,} rows, sum(ver) {prints['driver'][1]:,} (driver) "
            f"and {prints['spark'][0]:,} rows, sum(ver) {prints['spark'][1]:,} (Spark): "
            f"{'check ok' if ok else 'MISMATCH'}.",
        ]
    )
    return body, ok


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=10, help="change batches before the compactions")
    parser.add_argument("--batch", type=int, default=10_000, help="rows per change batch")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, help="data dir, kept for reuse (default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.batches, args.batch, args.repeats = 3_000, 3, 300, 1
    return args


def main() -> None:
    args = parse()
    work = args.work or Path(tempfile.mkdtemp(prefix="dbidx-service-jobs-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        body, ok = run(args, work)
        for name in ("built", "spark-local"):
            shutil.rmtree(work / name, ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(body)
    if args.write_results and not args.smoke:
        _report.write_section(SECTION, body)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
