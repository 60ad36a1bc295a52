"""Table benchmark: reading the current state after 1, 10 and 30 commits, before and after data compaction, beside
a delta-rs table of the same data in the same run; data bytes on disk per live row.

Data: `--keys` UUID keys over 30 daily partitions, loaded in one upsert; then commits of `--batch` rows (80% updates
to the last 7 days, 5% late updates to older days, 15% new keys), each with a version column `ver` = commit number.
dbidx writes through `upsert_arrow` (in process, no Spark: the read side is what is measured) and reads with
`reads.read_arrow`; delta-rs (the `peers` extra; skipped with a message if missing) writes the same load with
`write_deltalake` and every batch with `merge` on (dt, id), and reads with `DeltaTable.to_pyarrow_table()`. Both
reads are checked: one row per key, and the sum of `ver` equal to the expected one.
Second part: the time to open a table and plan a read of its latest state after `--completions` small commits
(default 10 000), with the completion log alone (checkpoint_interval 0: every record is read) and with a checkpoint
and archive bundles (only the checkpoint and the records after it are read).
Run: `python benchmarks/table_bench.py [--keys 2000000] [--batch 100000] [--completions 10000] [--part all|reads|open]
[--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow

DAYS = [f"2026-10-{d:02d}" for d in range(1, 31)]
CHECKPOINTS = (1, 10, 30)
COMPACT_EVERY = 500


def uuid_keys(n: int, rng: np.random.Generator) -> np.ndarray:
    """n random UUID-shaped strings."""
    raw = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).view(np.uint64)
    return np.array([f"{a:016x}{b:016x}" for a, b in raw], dtype=object)


class Stream:
    """The data set: the current key -> day map and the expected sum of versions."""

    def __init__(self, keys: int, rng: np.random.Generator) -> None:
        self.rng = rng
        self.keys = uuid_keys(keys, rng)
        self.days = rng.integers(0, len(DAYS), size=keys)
        self.version = np.zeros(keys, dtype=np.int64)

    def load(self) -> pa.Table:
        return self._rows(np.arange(len(self.keys)), 0)

    def batch(self, n: int, commit: int) -> pa.Table:
        """80% updates of recent days, 5% late updates, 15% new keys (distinct keys)."""
        recent = np.flatnonzero(self.days >= len(DAYS) - 7)
        old = np.flatnonzero(self.days < len(DAYS) - 7)
        picks = np.concatenate(
            [self.rng.choice(recent, int(n * 0.80), replace=False), self.rng.choice(old, int(n * 0.05), replace=False)]
        )
        fresh = n - len(picks)
        start = len(self.keys)
        self.keys = np.concatenate([self.keys, uuid_keys(fresh, self.rng)])
        self.days = np.concatenate([self.days, self.rng.integers(len(DAYS) - 3, len(DAYS), size=fresh)])
        self.version = np.concatenate([self.version, np.zeros(fresh, dtype=np.int64)])
        return self._rows(np.concatenate([picks, np.arange(start, start + fresh)]), commit)

    def _rows(self, idx: np.ndarray, commit: int) -> pa.Table:
        self.version[idx] = commit
        return pa.table(
            {
                "id": pa.array(self.keys[idx], pa.string()),
                "dt": pa.array(np.array(DAYS, dtype=object)[self.days[idx]], pa.string()),
                "ver": pa.array(np.full(len(idx), commit, dtype=np.int64)),
                "payload": pa.array(np.full(len(idx), "x" * 40, dtype=object), pa.string()),
            }
        )

    def expected(self) -> tuple[int, int]:
        return len(self.keys), int(self.version.sum())


def check(data: pa.Table, expected: tuple[int, int], who: str) -> None:
    got = (data.num_rows, int(pc.sum(data.column("ver")).as_py() or 0))
    if got != expected:
        raise SystemExit(f"{who}: read (rows, sum of ver) = {got}, expected {expected}")


def dbidx_files(table: Table) -> int:
    return sum(len(u.files) for u in reads.plan_read(table).units)


def data_bytes(root: Path) -> int:
    return sum(
        f.stat().st_size for f in root.rglob("*.parquet") if ".dbidx" not in f.parts and "_delta_log" not in f.parts
    )


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def open_times(work: Path, completions: int) -> tuple[str, dict[str, Any]]:
    """Open + refresh, and open + plan_read, of one table of `completions` one-key commits, without and with a
    checkpoint (the same log copied, then checkpointed twice so that the older records are archived)."""
    plain = Table.create(str(work / "plain"), num_shards=1, checkpoint_interval=0)
    write_s, _ = timed(lambda: [_one_key_commit(plain, i) for i in range(completions)])
    compactions = completions // COMPACT_EVERY
    shutil.copytree(work / "plain", work / "checkpointed")
    checkpointed = Table.open(str(work / "checkpointed"))
    checkpointed.checkpoint()
    _one_key_commit(checkpointed, completions)  # the newest checkpoint archives the records before the first
    checkpointed.checkpoint()
    rows, figures = [], {}
    for name, path in (("log only", work / "plain"), ("checkpoint + archive", work / "checkpointed")):
        open_s, _ = _report.median_time(lambda: Table.open(str(path)).refresh(), 3)
        plan_s, _ = _report.median_time(lambda: reads.plan_read(Table.open(str(path))), 3)
        files = len(list((path / ".dbidx" / "timeline" / "completed").iterdir()))
        rows.append(
            [
                name,
                f"{Table.open(str(path)).refresh().applied_seq:,}",
                files,
                f"{open_s * 1000:.1f}",
                f"{plan_s * 1000:.1f}",
            ]
        )
        figures[name] = {"open_s": open_s, "plan_s": plan_s, "record_files": files}
    body = "\n\n".join(
        [
            f"## Opening a table after {completions:,} completions, without and with a checkpoint",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. One-key commits over 30 partitions through "
            f"the library writer ({write_s / completions * 1000:.1f} ms per commit, log only), the index compacted and "
            f"cleaned every {COMPACT_EVERY} commits ({compactions} times). Open = `Table.open(..).refresh()`; "
            "plan = open + `reads.plan_read` (what a read of the latest state needs). Median of 3, local disk; on "
            "an object store every record file read is a request, so the gap grows with the request latency.",
            _report.table(["timeline", "completions", "record files listed", "open ms", "open + plan ms"], rows),
        ]
    )
    return body, figures


def _one_key_commit(table: Table, i: int) -> None:
    """One commit; every COMPACT_EVERY commits the index is compacted and cleaned, as a pipeline's maintenance
    would (so the state a checkpoint holds is the table's, not one delta file per commit ever made)."""
    with table.new_commit() as writer:
        writer.insert(f"dt={DAYS[i % len(DAYS)]}", [f"k{i}"], "fg")
    if (i + 1) % COMPACT_EVERY == 0:
        table.compact()
        table.clean(retain_completions=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--commits", type=int, default=30)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--completions", type=int, default=10_000)
    parser.add_argument("--part", choices=("all", "reads", "open"), default="all")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.batch, args.commits, args.completions, args.shards = 3_000, 300, 3, 40, 2
    if args.part in ("all", "open"):
        work = Path(tempfile.mkdtemp(prefix="dbidx-open-bench-"))
        try:
            body, _figures = open_times(work, args.completions)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if args.write_results and not args.smoke:
            _report.write_section("table-open", body)
        print(body)
    if args.part == "open":
        return
    try:
        import deltalake
    except ImportError:
        deltalake = None
        print("delta-rs (deltalake) is not installed: its column is skipped (pip install -e '.[peers]')")
    try:
        import polars
    except ImportError:
        polars = None
        print("polars is not installed: the read of dbidx's table through its Delta log is skipped")
    work = Path(tempfile.mkdtemp(prefix="dbidx-table-bench-"))
    rows: list[list[Any]] = []
    try:
        stream = Stream(args.keys, np.random.default_rng(20261123))
        table = Table.create(str(work / "dbidx"), num_shards=args.shards)
        config = CacheConfig(base_path=str(work / "cache"))
        delta_uri = str(work / "delta")
        load = stream.load()
        load_s, _ = timed(lambda: upsert_arrow(load, table, key="id", partition="dt", cache_config=config))
        if deltalake is not None:
            delta_load_s, _ = timed(lambda: deltalake.write_deltalake(delta_uri, load, partition_by=["dt"]))
        for commit in range(1, args.commits + 1):
            batch = stream.batch(args.batch, commit)
            commit_s, _ = timed(lambda: upsert_arrow(batch, table, key="id", partition="dt", cache_config=config))
            merge_s = None
            if deltalake is not None:
                merge_s, _ = timed(
                    lambda: (
                        deltalake.DeltaTable(delta_uri)
                        .merge(batch, "t.dt = s.dt and t.id = s.id", source_alias="s", target_alias="t")
                        .when_matched_update_all()
                        .when_not_matched_insert_all()
                        .execute()
                    )
                )
            if commit not in CHECKPOINTS and commit != args.commits:
                continue
            expected = stream.expected()
            read_s, data = timed(lambda: reads.read_arrow(table))
            check(data, expected, "dbidx")
            latest = table.latest()
            written = f"{len(latest.data_files)} / {len(latest.dv_files)} / {len(latest.files)}"
            row: list[Any] = [commit, commit_s, written, dbidx_files(table), read_s]
            polars_s = "-"
            if polars is not None:
                polars_s, frame = timed(lambda: polars.read_delta(str(work / "dbidx")))
                check(frame.to_arrow(), expected, "polars on dbidx's Delta log")
            row += [polars_s, data_bytes(work / "dbidx") / expected[0]]
            if deltalake is not None:
                delta_s, delta = timed(lambda: deltalake.DeltaTable(delta_uri).to_pyarrow_table())
                check(delta, expected, "delta-rs")
                row += [
                    merge_s,
                    len(deltalake.DeltaTable(delta_uri).file_uris()),
                    delta_s,
                    data_bytes(work / "delta") / expected[0],
                ]
            else:
                row += ["-", "-", "-", "-"]
            rows.append(row)
            print("row:", row, flush=True)
        # After compaction (data, then clean): the same rows from one file per group.
        compact_s, result = timed(lambda: table.compact_data(min_files=2))
        table.clean(retain_completions=0)
        read_s, data = timed(lambda: reads.read_arrow(table))
        check(data, stream.expected(), "dbidx after compaction")
        polars_s = "-"
        if polars is not None:
            polars_s, frame = timed(lambda: polars.read_delta(str(work / "dbidx")))
            check(frame.to_arrow(), stream.expected(), "polars on dbidx's Delta log")
        rows.append(
            [
                f"{args.commits} + data compaction",
                compact_s,
                "-",
                dbidx_files(table),
                read_s,
                polars_s,
                data_bytes(work / "dbidx") / stream.expected()[0],
                "-",
                "-",
                "-",
                "-",
            ]
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = "\n\n".join(
        [
            f"## Table reads at {args.keys:,} keys: dbidx vs delta-rs, before and after data compaction",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. {args.keys:,} UUID keys in 30 daily "
            f"partitions, {args.shards} shards; commits of {args.batch:,} rows (80% recent updates, 5% late updates, 15% "
            f"new keys). Initial load: dbidx upsert_arrow {load_s:.1f} s"
            + (f", delta-rs write_deltalake {delta_load_s:.1f} s" if deltalake is not None else "")
            + f". Data compaction took {compact_s:.1f} s for {result.file_groups:,} file groups "
            f"({result.files_replaced:,} files). Reads are full scans into Arrow, checked (rows, sum of versions): "
            "dbidx's own reader (`read_arrow`: files minus deletion vectors) and polars `read_delta` of the same table "
            "through its Delta log. Commit s: the commit just before the read (dbidx `upsert_arrow` in process, no "
            "Spark; delta-rs `merge` on (dt, id)); files written = data / DV / index files of that commit.",
            _report.table(
                [
                    "after commits",
                    "dbidx commit s",
                    "files written",
                    "dbidx live files",
                    "dbidx read s",
                    "polars read of dbidx s",
                    "dbidx data B/row",
                    "delta merge s",
                    "delta files",
                    "delta read s",
                    "delta data B/row",
                ],
                rows,
            ),
        ]
    )
    if args.write_results and not args.smoke:
        _report.write_section(f"table-{args.keys}", body)  # one section per size: 1 M and 10 M side by side
    print(body)


if __name__ == "__main__":
    main()
