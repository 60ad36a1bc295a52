"""How long the Delta readers take on a dbidx table with many deletion vectors, logged inline (dbidx's default) and
as pointers into dbidx's DV files (`dbidx.deletionVectors.storage` = `file`, which Delta Spark's VACUUM needs).

Why: delta-rs (deltalake, and polars through it) deadlocks planning a scan once a table has more file-backed vectors
than its runtime has blocking threads (delta-io/delta-rs#4657): that is why inline is the default. This script builds
the same table both ways (one upsert per batch into every partition, each superseding rows of the last batch's
files, so every live file but the newest of each partition has a vector; the table services off, so nothing compacts
the shape away), then reads each one `--repeats` times with deltalake (`deletion_vectors()` and a QueryBuilder
count), polars and DuckDB, each reader in a process of its own with a time limit, checking every count against
dbidx's: a reader that does not finish in `--limit` seconds is reported as hung (and killed).

Run: `python benchmarks/dv_reader_bench.py [--partitions 100] [--batches 10] [--repeats 10] [--write-results]`;
`--smoke` builds a tiny table (seconds; used by tests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

from dbidx.config import CacheConfig
from dbidx.data.deletion_vectors import VECTOR_STORAGE
from dbidx.spark_integration.local import upsert_arrow
from dbidx.table.facade import Table

READERS = ("deltalake deletion_vectors()", "deltalake QueryBuilder", "polars read_delta", "duckdb delta_scan")
# One reader's reads, run in a child process (argv: reader, path, repeats): prints each read's seconds and count.
CHILD = """
import json, sys, time
import duckdb, deltalake, polars, pyarrow as pa  # imported before the clock starts
reader, path, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
def read():
    if reader == "deltalake deletion_vectors()":
        from deltalake import DeltaTable
        pa.table(DeltaTable(path).deletion_vectors().read_all())
        return -1  # a count of files, not rows
    if reader == "deltalake QueryBuilder":
        from deltalake import DeltaTable, QueryBuilder
        qb = QueryBuilder().register("t", DeltaTable(path))
        return int(pa.table(qb.execute("select count(*) as n from t").read_all())["n"][0].as_py())
    if reader == "polars read_delta":
        import polars as pl
        return len(pl.read_delta(path, columns=["id"]))
    import duckdb
    from dbidx.demo import duckdb_delta_extension
    con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
    con.execute(f"LOAD '{duckdb_delta_extension()}'")
    return int(con.execute(f"select count(*) from delta_scan('{path}')").fetchone()[0])
for _ in range(repeats):
    start = time.perf_counter()
    rows = read()
    print(json.dumps([time.perf_counter() - start, rows]), flush=True)
"""


def build(path: Path, cache: Path, partitions: int, batches: int, rows: int, form: str) -> int:
    """The table: `batches` upserts of `rows` keys into each of `partitions` partitions, each updating half of the
    previous batch's keys, its vectors logged in `form`. Returns dbidx's row count."""
    table = Table.create(str(path), num_shards=2)
    table.configure_services(after_commit=False)
    table.set_delta_properties({VECTOR_STORAGE: form})
    for batch in range(batches):
        ids, days, values = [], [], []
        for p in range(partitions):
            first = batch * rows // 2  # half the keys are the last batch's: its files get vectors
            ids += [f"k{k}" for k in range(first, first + rows)]
            days += [f"p{p:04d}"] * rows
            values += [batch] * rows
        data = pa.table({"id": ids, "dt": days, "v": pa.array(values, pa.int64())})
        upsert_arrow(data, Table.open(str(path)), key="id", partition="dt", cache_config=CacheConfig(str(cache)))
    return Table.open(str(path)).data_view().live_rows()


def measure(path: str, expected: int, repeats: int, limit: float) -> dict[str, tuple[float, float] | None]:
    """reader -> (median s, max s) over `repeats` reads in a process of its own, each count checked against dbidx's;
    None: the reader did not finish within `limit` seconds (killed)."""
    out: dict[str, tuple[float, float] | None] = {}
    for reader in READERS:
        try:
            done = subprocess.run(
                [sys.executable, "-c", CHILD, reader, path, str(repeats)],
                capture_output=True,
                text=True,
                timeout=limit,
            )
        except subprocess.TimeoutExpired:
            out[reader] = None
            continue
        if done.returncode != 0:
            raise SystemExit(f"{reader} failed on {path}: {done.stderr[-2000:]}")
        reads = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
        for _seconds, got in reads:
            if got not in (-1, expected):
                raise SystemExit(f"{reader} read {got} rows of {path}, dbidx {expected}")
        times = [seconds for seconds, _ in reads]
        out[reader] = (statistics.median(times), max(times))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=100)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rows", type=int, default=50, help="keys per partition and batch")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--limit", type=float, default=120.0, help="seconds a reader may take for all its reads")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.partitions, args.batches, args.rows, args.repeats = 10, 3, 10, 2
    work = Path(tempfile.mkdtemp(prefix="dv-reader-bench-", dir=args.work))
    try:
        rows, figures = [], {}
        for form in ("inline", "file"):
            path = work / form
            start = time.perf_counter()
            live = build(path, work / f"cache-{form}", args.partitions, args.batches, args.rows, form)
            built = time.perf_counter() - start
            view = Table.open(str(path)).data_view()
            vectors = sum(1 for f in view.live() if view.vector_of(f.record.path) is not None)
            dv_files = len(
                {view.vector_of(f.record.path).file.path for f in view.live() if view.vector_of(f.record.path)}
            )
            versions = sorted((path / "_delta_log").glob("*.json"))[2:]  # the upserts after the first (vectors)
            log_kb = statistics.median(v.stat().st_size for v in versions) / 1024
            for reader, timing in measure(str(path), live, args.repeats, args.limit).items():
                if timing is None:
                    rows.append([form, vectors, dv_files, log_kb, reader, f"hung (> {args.limit:.0f} s)", "-"])
                    figures[f"{form} {reader}"] = {"hung_after_s": args.limit}
                else:
                    rows.append([form, vectors, dv_files, log_kb, reader, timing[0], timing[1]])
                    figures[f"{form} {reader}"] = {"median_s": timing[0], "max_s": timing[1]}
            figures[f"{form} version_kb"] = log_kb
            print(f"{form}: {live:,} rows, {vectors:,} vectors in {dv_files:,} DV files, built in {built:.1f} s")
        body = "\n\n".join(
            [
                "### Delta readers on many deletion vectors: inline against file-backed",
                f"Machine: {_report.machine()}. Command: `{_report.command()}`. One table per form, "
                f"{args.partitions} partitions x {args.batches} batches (table services off, so the vectors stay); "
                f"{args.repeats} reads per reader in a process of its own, each count checked against dbidx's; a reader "
                f"still reading after {args.limit:.0f} s is reported hung. "
                "Upsert version KB: the median size of an upsert's Delta version after the first (each touched file's "
                "vector twice: on its remove and its add).",
                _report.table(
                    ["vectors logged", "vectors", "DV files", "upsert version KB", "reader", "median s", "max s"], rows
                ),
            ]
        )
        print(body)
        if args.write_results and not args.smoke:
            _report.publish("dv_readers", body, figures)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
