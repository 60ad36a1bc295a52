"""The end-to-end demo behind `make demo` / `dbidx demo`: a realistic change stream upserted through Spark.

Steps: create a table; generate a change stream (daily partitions; mostly updates to recent days, some late updates
to old days, deletes, new keys, a few same-key repeats) with numpy; upsert the initial load and B batches through
a local Spark session, one of them via Structured Streaming `foreachBatch`; restart Spark midway (the caches on
local disk are reused and caught up: a warm restart); compact the index; then check that `read_table` holds
exactly one row per key, equal to an independent pandas computation of the expected state. Any wrong answer
raises DbidxError.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.errors import DbidxError, InvalidInputError
from dbidx.table.facade import Table
from dbidx.spark_integration.api import upsert
from dbidx.spark_integration.driver import CommitSummary
from dbidx.spark_integration.reads import read_table
from dbidx.spark_integration.session import quiet_local_session

Echo = Callable[[str], None] | None
FIRST_DAY = date(2025, 6, 1)
COLUMNS = ["id", "dt", "seq", "amount", "_dbidx_delete"]
DEMO_MARKER = ".dbidx-demo"


@dataclass
class ChangeStream:
    """Generates batches and remembers which keys are live on which day (numpy, no dbidx involved)."""

    keys: int
    days: int
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))
    home: np.ndarray = field(init=False)  # day index of every key ever created
    alive: np.ndarray = field(init=False)
    serial: int = 0

    def __post_init__(self) -> None:
        self.home = np.empty(0, dtype=np.int64)
        self.alive = np.empty(0, dtype=bool)

    def _frame(self, ids: np.ndarray, days: np.ndarray, deletes: np.ndarray, batch: int) -> pd.DataFrame:
        n = len(ids)
        return pd.DataFrame(
            {
                "id": [f"user-{i:09d}" for i in ids],
                "dt": [(FIRST_DAY + timedelta(days=int(d))).isoformat() for d in days],
                "seq": batch * 10_000_000 + np.arange(n, dtype=np.int64),
                "amount": np.round(self.rng.gamma(2.0, 40.0, n), 2),
                "_dbidx_delete": deletes,
            }
        )

    def _new(self, n: int, day: int) -> np.ndarray:
        ids = np.arange(self.serial, self.serial + n)
        self.serial += n
        self.home = np.concatenate([self.home, np.full(n, day)])
        self.alive = np.concatenate([self.alive, np.ones(n, dtype=bool)])
        return ids

    def initial(self) -> pd.DataFrame:
        """Batch 0: every key once, spread evenly over the days."""
        ids = self._new(self.keys, 0)
        self.home[ids] = ids % self.days
        return self._frame(ids, self.home[ids], np.zeros(len(ids), dtype=bool), 0)

    def batch(self, number: int, rows: int) -> pd.DataFrame:
        """70% updates of recent days, 5% late updates of old days, 5% deletes, 20% new keys on a new day."""
        newest = self.days - 1 + number
        live = np.flatnonzero(self.alive)
        recent = live[self.home[live] >= newest - 3]
        old = live[self.home[live] < newest - 3]
        n_upd, n_late, n_del = int(rows * 0.70), int(rows * 0.05), int(rows * 0.05)
        pool = recent if len(recent) >= n_upd else live
        upd = self.rng.choice(pool, min(n_upd, len(pool)), replace=False)
        late_pool = old if len(old) else live
        late = self.rng.choice(late_pool, min(n_late, len(late_pool)), replace=False)
        del_pool = np.setdiff1d(live, np.concatenate([upd, late]))  # small tables: fewer deletes than asked
        dels = self.rng.choice(del_pool, min(n_del, len(del_pool)), replace=False)
        self.alive[dels] = False
        n_late, n_del = len(late), len(dels)
        new = self._new(rows - len(upd) - n_late - n_del, newest)
        repeats = self.rng.choice(upd, max(1, rows // 100))  # a few keys twice in one batch: the later row wins
        ids = np.concatenate([upd, late, dels, new, repeats])
        deletes = np.concatenate(
            [np.zeros(len(upd) + n_late, bool), np.ones(n_del, bool), np.zeros(len(new) + len(repeats), bool)]
        )
        order = self.rng.permutation(len(ids))
        return self._frame(ids[order], self.home[ids[order]], deletes[order], number)


def expected_state(batches: list[pd.DataFrame]) -> pd.DataFrame:
    """The truth, computed with pandas alone: per (dt, id) the last row in arrival order, deletes removed."""
    everything = pd.concat(batches, ignore_index=True).sort_values("seq", kind="stable")
    latest = everything.drop_duplicates(subset=["dt", "id"], keep="last")
    return latest[~latest["_dbidx_delete"]].drop(columns="_dbidx_delete")


def _start_spark(local_dir: Path, say: Callable[[str], None], why: str) -> Any:
    say(f"  starting Spark ({why}) ...")
    started = time.perf_counter()
    spark = quiet_local_session(local_dir, app_name="dbidx-demo")
    say(f"  Spark is up in {time.perf_counter() - started:.1f} s")
    return spark


def _line(number: int | str, how: str, s: CommitSummary) -> str:
    return (
        f"  batch {number:>2} {how:<9} {s.rows:>8,} rows {s.rows / max(s.seconds, 1e-9):>9,.0f} rows/s  "
        f"ins {s.inserts:>7,} upd {s.updates:>7,} del {s.deletes:>5,}  hit {s.hit_rate:6.1%}  "
        f"on-demand {s.on_demand_loads:>2} ({s.stall_seconds:4.2f} s)  catch-up {s.catchup_entries:>6,}"
    )


def prepare_workdir(root: Path, force: bool = False) -> None:
    """Empty the demo's directory for a new run, but only one the demo created (it leaves a marker file) or an
    empty one: a directory holding anything else is refused unless `force` (the demo deletes what it holds)."""
    marker = root / DEMO_MARKER
    if root.exists() and not root.is_dir():
        raise InvalidInputError(f"--dir {root} is a file, not a directory")
    if root.is_dir() and any(root.iterdir()) and not marker.exists() and not force:
        raise InvalidInputError(
            f"--dir {root} is not empty and was not created by `dbidx demo`; the demo replaces "
            "its directory on every run, so choose another --dir (or pass --force to let it "
            "delete what is there)"
        )
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    marker.write_text("created by `dbidx demo`; the next run replaces this directory\n")


def run_demo(
    workdir: str | Path,
    keys: int = 200_000,
    days: int = 10,
    batches: int = 6,
    batch_rows: int | None = None,
    echo: Echo = print,
    force: bool = False,
) -> dict[str, Any]:
    """Run the demo; returns the report (also printed through `echo` unless None)."""
    say = echo or (lambda _msg: None)
    if keys < 100 or days < 2 or batches < 2:
        raise InvalidInputError("the demo needs --keys >= 100, --days >= 2 and --batches >= 2")
    root = Path(workdir)
    prepare_workdir(root, force)
    started = time.perf_counter()
    table = Table.create(str(root / "table"), num_shards=2)
    config = CacheConfig(base_path=str(root / "_cache"))
    spec = BucketSpec(capacity=max(1_000, keys // days // 2))
    stream = ChangeStream(keys, days)
    rows = batch_rows or max(1_000, keys // 4)
    generated: list[pd.DataFrame] = []
    report: dict[str, Any] = {"table": table.uri, "keys": keys, "days": days, "batches": []}
    say(f"dbidx demo: table {table.uri}, 2 key shards, dynamic buckets of {spec.capacity:,} keys, Spark local[2]")
    say(
        f"  change stream: an initial load of {keys:,} keys over {days} daily partitions, then {batches} batches of "
        f"{rows:,} rows (updates of recent days, late updates, deletes, new keys, repeats)"
    )
    say(
        "  per batch: 'catch-up' = index entries committed since a shard's local cache last saw the table, applied "
        "to it before tagging (batch 1 applies the whole initial load, which upserts never write to caches)"
    )
    say(
        "             'on-demand' = partitions a batch touched that were not in the local cache yet, loaded from "
        "the persisted index while the batch waited (the 'stall' seconds)"
    )
    spark = _start_spark(root / "_spark", say, "the first application; a JVM start takes 5-15 s")
    try:
        # 1. The initial load, then B change batches; the middle one arrives through Structured Streaming.
        streamed_at, restart_at = batches // 2, batches // 2 + 1
        for number in range(batches + 1):
            frame = stream.initial() if number == 0 else stream.batch(number, rows)
            generated.append(frame)
            if number == restart_at:
                # 2. Warm restart: a new Spark application; the cache directories on local disk are reused.
                spark.stop()
                spark = _start_spark(root / "_spark", say, "a second application in the same JVM: a warm restart")
                say("  -- the next batch reopens the caches the first application left on local disk")
            say(f"  batch {number:>2} running ({len(frame):,} rows) ...")
            if number == streamed_at:
                summary, how = _streamed(spark, root, frame, table, config, spec, number), "streaming"
            else:
                summary, how = (
                    upsert(
                        spark.createDataFrame(frame), table, key="id", partition="dt", buckets=spec, cache_config=config
                    ),
                    "batch",
                )
            say(_line(number, how, summary))
            report["batches"].append(
                {"batch": number, "via": how, **{k: v for k, v in summary.to_dict().items() if k != "per_shard"}}
            )
        warm = report["batches"][restart_at]
        if warm["on_demand_loads"] > table.num_shards:  # only the batch's new day may be cold (once per shard)
            raise DbidxError(
                f"demo check failed: after the restart {warm['on_demand_loads']} partitions were "
                "loaded again; the warm restart should have reused them"
            )
        # 3. Footprint: the cache's bytes per entry vs the index's (compacted) bytes per entry.
        report.update(_footprint(table, summary, root / "_cache"))
        say(
            f"  footprint ({report['live_keys']:,} keys): cache {report['cache_bytes_per_entry']:.1f} B/entry on "
            f"local disk ({report['cache_sst_bytes_per_entry']:.1f} in SST files, the rest RocksDB's fixed files), "
            f"index {report['index_bytes_per_entry']:.1f} B/entry in the index after compaction"
        )
        say(
            "    (same definitions as benchmarks/footprint_bench.py; the demo's sequential 'user-NNNNNNNNN' keys "
            "compress far better than the README's 10 M UUID keys, and fixed files weigh more at this size)"
        )
        # 4. The check: the table's rows equal an independent pandas computation of the expected state.
        expected = expected_state(generated)
        actual = read_table(spark, table).select("id", "dt", "seq", "amount").toPandas()
        _compare(actual, expected)
        report.update(rows_checked=len(expected))
        say(f"  check: read_table has exactly one row per key, {len(expected):,} rows, equal to the pandas oracle")
        # 5. The same table is a Delta Lake table: other engines read it without dbidx, and see the same rows.
        report["other_readers"] = other_readers(table.io.path(""), expected, say)
        report.update(seconds=round(time.perf_counter() - started, 1))
        # 6. A picture: time and cache hit rate per batch.
        report["chart"] = _chart(report, root, say)
        say(f"done in {report['seconds']} s")
    finally:
        spark.stop()
    return report


def _chart(report: dict[str, Any], root: Path, say: Callable[[str], None]) -> str | None:
    """The demo's PNG chart (dbidx.charts.demo_chart) under the work dir; None, said, without matplotlib."""
    from dbidx.charts import demo_chart

    footer = (
        f"{report['keys']:,} keys over {report['days']} days, {len(report['batches']) - 1} change batches, "
        f"Spark local[2], 2 key shards; whole demo {report['seconds']} s (JVM starts included)"
    )
    path = demo_chart(report["batches"], root / "demo-batches.png", footer)
    say(
        f"  chart: {path} (batch seconds and cache hit rate per batch)"
        if path is not None
        else "  chart: not drawn, matplotlib is not installed (pip install matplotlib)"
    )
    return None if path is None else str(path)


def _streamed(
    spark: Any, root: Path, frame: pd.DataFrame, table: Table, config: CacheConfig, spec: BucketSpec, number: int
) -> CommitSummary:
    """Upsert one batch through a Structured Streaming query with foreachBatch."""
    incoming = root / "_incoming"
    incoming.mkdir(exist_ok=True)
    frame.to_parquet(incoming / f"batch-{number:03d}.parquet", index=False)
    summaries: list[CommitSummary] = []
    schema = spark.read.parquet(str(incoming)).schema
    query = (
        spark.readStream.schema(schema)
        .parquet(str(incoming))
        .writeStream.foreachBatch(
            lambda df, _id: summaries.append(
                upsert(df, table, key="id", partition="dt", buckets=spec, cache_config=config)
            )
        )
        .option("checkpointLocation", str(root / "_checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if len(summaries) != 1:
        raise DbidxError(f"demo check failed: the streaming query ran {len(summaries)} micro-batches, expected 1")
    return summaries[0]


def _footprint(table: Table, last: CommitSummary, cache_base: Path) -> dict[str, Any]:
    """Bytes per entry as benchmarks/footprint_bench.py defines them: the whole shard directory (and, apart, its
    SST files) over the cache's entries; the index's RLI files after compaction and cleaning over its live keys."""
    table.compact(min_files=2)
    table.clean(retain_completions=0)
    live = sum(p.live_keys for p in table.partitions())
    rli = sum(size for rel, size in table.io.list_files_recursive(".dbidx/rli"))
    cache_bytes = sum(m["cache_disk_bytes"] for m in last.per_shard)
    cache_entries = sum(m["cache_entries"] for m in last.per_shard)
    sst_bytes = sum(f.stat().st_size for f in cache_base.glob("*/shard-*/*.sst"))
    index_per_entry = round(rli / max(live, 1), 2)
    return {
        "live_keys": live,
        "index_bytes_per_entry": index_per_entry,
        "mdt_bytes_per_entry": index_per_entry,  # the 0.1 name of index_bytes_per_entry, kept for 0.2 only
        "cache_bytes_per_entry": round(cache_bytes / max(cache_entries, 1), 2),
        "cache_sst_bytes_per_entry": round(sst_bytes / max(cache_entries, 1), 2),
    }


def duckdb_delta_extension() -> str | None:
    """The delta extension file the `duckdb-ext-delta` package ships for the installed duckdb (None if absent): a
    file to LOAD, so nothing is downloaded."""
    import glob

    import duckdb

    root = os.path.join(os.path.dirname(os.path.dirname(duckdb.__file__)), "duckdb_ext", "extensions")
    found = sorted(glob.glob(os.path.join(root, f"v{duckdb.__version__}", "*", "delta.duckdb_extension")))
    return found[0] if found else None


def other_readers(path: str, expected: pd.DataFrame, say: Callable[[str], None]) -> dict[str, Any]:
    """Read the table's Delta log with Polars and DuckDB (when installed: `make demo` installs both) and check that
    each sees exactly the expected rows; returns, per engine, its row count or why it was skipped."""
    want = sorted(zip(expected["id"], expected["seq"].astype("int64")))
    readers: dict[str, Callable[[], list[tuple[str, int]] | None]] = {}
    skipped: dict[str, str] = {}

    def via_delta_spark(table_path: str) -> list[tuple[str, int]] | None:
        """Delta Lake on Spark in a process of its own (spark_integration/delta_spark_check.py says why)."""
        command = [sys.executable, "-m", "dbidx.spark_integration.delta_spark_check", table_path, "id", "seq"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode == 3:
            skipped["Delta Spark"] = done.stderr.strip()
            return None
        if done.returncode != 0:
            raise DbidxError(f"demo check failed: Delta Spark could not read {table_path}: {done.stderr[-2000:]}")
        return sorted((r[0], int(r[1])) for r in (json.loads(line) for line in done.stdout.splitlines() if line))

    try:
        import polars as pl

        readers["polars"] = lambda: sorted(pl.read_delta(path).select("id", "seq").iter_rows())
    except ImportError:
        pass
    try:
        import duckdb

        extension = duckdb_delta_extension()
        if extension is not None:

            def via_duckdb() -> list[tuple[str, int]]:
                con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
                con.execute(f"LOAD '{extension}'")
                return sorted(con.execute(f"select id, seq from delta_scan('{path}')").fetchall())

            readers["duckdb"] = via_duckdb
    except ImportError:
        pass
    readers["Delta Spark"] = lambda: via_delta_spark(path)
    report: dict[str, Any] = {}
    for name, read in readers.items():
        started = time.perf_counter()
        rows = read()
        if rows is not None and rows != want:
            raise DbidxError(
                f"demo check failed: {name} reads {len(rows):,} rows from the table's Delta log, "
                f"{len(set(rows) ^ set(want)):,} of them differ from the {len(want):,} expected"
            )
        if rows is None:
            report[name] = "skipped: " + skipped.get(name, "")
            say(f"  open table: {name} skipped ({skipped.get(name, '')})")
            continue
        report[name] = len(rows)
        say(
            f"  open table: {name} reads the same {len(rows):,} rows from {path} "
            f"({time.perf_counter() - started:.1f} s, Delta log + deletion vectors, no dbidx involved)"
        )
    for name in ("polars", "duckdb"):
        if name not in readers:
            report[name] = "not installed"
            say(f"  open table: {name} not installed (pip install 'dbidx[dev]' for polars, duckdb, duckdb-ext-delta)")
    return report


def _compare(actual: pd.DataFrame, expected: pd.DataFrame) -> None:
    dupes = actual.duplicated(subset=["dt", "id"]).sum()
    if dupes:
        raise DbidxError(f"demo check failed: read_table has {dupes} duplicate (dt, id) rows")
    a = actual.sort_values(["dt", "id"]).reset_index(drop=True)
    e = expected[["id", "dt", "seq", "amount"]].sort_values(["dt", "id"]).reset_index(drop=True)
    if len(a) != len(e) or not a.equals(e.astype(a.dtypes.to_dict())):
        merged = a.merge(e, on=["dt", "id"], how="outer", indicator=True, suffixes=("", "_expected"))
        wrong = merged[(merged["_merge"] != "both") | (merged["seq"] != merged["seq_expected"])]
        raise DbidxError(
            f"demo check failed: {len(wrong)} rows differ from the expected state, e.g.\n{wrong.head(5).to_string()}"
        )
