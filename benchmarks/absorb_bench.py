"""Absorb benchmark: what dbidx pays when another engine OPTIMIZEs its table, beside the floor of that work.

What is measured, in one run, without Spark (docs/FORMAT.md section 12c):
  1. Build: a dbidx table of `--keys` UUID keys over `--days` daily partitions (`dt=YYYY-MM-DD`, each key's day at
     random), columns id (the key, string), dt, v (int64), written with `upsert_arrow` in batches of 500,000 rows
     (the first on the bulk path), then 3 steady batches of 100,000 rows (80% updates of existing keys at random,
     20% new keys), so the data files carry deletion vectors. Each is one run; the build's total and the steady
     median are reported.
  2. Another engine's OPTIMIZE: `deltalake.DeltaTable(path).optimize.compact()` (delta-rs; its own cost, timed).
  3. dbidx absorbs that Delta version: `Table.open(path).absorb_delta_log()` on a Table opened for it (the open is
     in the time); files removed / added and the index entries of the absorb record (the keys re-pointed to the
     new files). Peak RSS of this process during the step (VmHWM, reset before it), beside its RSS when the step
     began (the process also holds the benchmark's key model and the writer's open caches).
  4. The anchor, in the same run: `pyarrow.parquet.read_table(path, columns=["id"])` of every file the version
     touched (removed + added, from its `_delta_log` JSON), one after another: the floor, since absorbing must read
     those keys.
  5. Two steady dbidx upserts of 100,000 rows (same shape as in 1) after the absorb: the first pays the caches'
     catch-up of the re-pointed keys, the second shows whether anything is left to pay.
At the end the table is checked: `verify_table(table).ok`, and the row count deltalake's QueryBuilder reads ==
dbidx's `read_arrow(table, columns=["id"]).num_rows` == the distinct keys written (QueryBuilder's count of distinct
ids and its sum of v are checked too); a failed check is reported and the script exits non-zero (nothing published).
Caches: one CacheConfig(base_path=<work>/absorb-cache) for every upsert, as one long-lived writer would have.
Run: `python benchmarks/absorb_bench.py [--keys 10000000] [--days 30] [--shards 2] [--work DIR] [--smoke]
[--write-results]` (or `make bench-absorb`). The table and caches live in `--work` (default: a temporary dir under
the current directory) and are removed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from speed_bench import STEP_HEADERS, summary_cells

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

KEY, PARTITION = "id", "dt"
BUILD_BATCH = 500_000
STEADY_ROWS, STEADY_BEFORE, STEADY_AFTER = 100_000, 3, 2
UPDATE_SHARE = 0.80
FIRST_DAY = dt.date(2026, 10, 1)
SEED = 42
MIB = 1 << 20
CELL_HEADERS = STEP_HEADERS[5:]  # on-demand loads ... hit rate: the upsert summary's cache figures


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The data.

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_UUID_HEX_AT = [i for i in range(36) if i not in (8, 13, 18, 23)]  # where the 32 hex digits go


def uuid_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """n random (version 4) UUIDs in their 36-character text form, as an (n, 36) uint8 array."""
    raw = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x40
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80
    digits = np.empty((n, 32), dtype=np.uint8)
    digits[:, 0::2], digits[:, 1::2] = raw >> 4, raw & 0x0F
    text = np.full((n, 36), ord("-"), dtype=np.uint8)
    text[:, _UUID_HEX_AT] = _HEX[digits]
    return text


def string_array(text: np.ndarray) -> pa.Array:
    """An (n, 36) uint8 array of ASCII as a pyarrow string array, without a Python object per key."""
    n, width = text.shape
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int64)
    data = np.ascontiguousarray(text).reshape(-1)
    return pa.Array.from_buffers(pa.large_string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]).cast(
        pa.string()
    )


class Keys:
    """Every key written so far, its day and its v, so a batch can update existing keys and the end can check."""

    def __init__(self, n: int, days: int, rng: np.random.Generator) -> None:
        self.rng, self.days_n = rng, days
        self.days = np.array([(FIRST_DAY + dt.timedelta(days=d)).isoformat() for d in range(days)], dtype=object)
        self.text = uuid_bytes(n, rng)
        self.day = rng.integers(0, days, size=n, dtype=np.int64)
        self.v = np.zeros(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.day)

    def rows(self, idx: np.ndarray, value: int) -> pa.Table:
        self.v[idx] = value
        return pa.table(
            {
                KEY: string_array(self.text[idx]),
                PARTITION: pa.array(self.days[self.day[idx]], pa.string()),
                "v": pa.array(np.full(len(idx), value, dtype=np.int64)),
            }
        )

    def steady(self, rows: int, value: int) -> pa.Table:
        """`rows` rows: 80% updates of distinct existing keys (any day, in place), 20% new keys (any day)."""
        updates = self.rng.choice(len(self), int(rows * UPDATE_SHARE), replace=False)
        fresh = rows - len(updates)
        start = len(self)
        self.text = np.concatenate([self.text, uuid_bytes(fresh, self.rng)])
        self.day = np.concatenate([self.day, self.rng.integers(0, self.days_n, size=fresh, dtype=np.int64)])
        self.v = np.concatenate([self.v, np.zeros(fresh, dtype=np.int64)])
        return self.rows(np.concatenate([np.sort(updates), np.arange(start, start + fresh)]), value)


# ---------------------------------------------------------------------------------------------------------------
# The steps.


def upsert(batch: pa.Table, table: Table, config: CacheConfig) -> tuple[float, dict[str, Any]]:
    """Wall seconds and summary of one upsert_arrow."""
    start = time.perf_counter()
    summary = upsert_arrow(batch, table, key=KEY, partition=PARTITION, cache_config=config).to_dict()
    return time.perf_counter() - start, summary


def version_files(root: Path, version: int) -> tuple[list[str], list[str], dict[str, Any]]:
    """(removed, added) data file paths of a Delta version, from its JSON in _delta_log, and its commitInfo."""
    removed, added, info = [], [], {}
    for line in (root / "_delta_log" / f"{version:020d}.json").read_text().splitlines():
        action = json.loads(line) if line.strip() else {}
        if "remove" in action:
            removed.append(str(root / unquote(action["remove"]["path"])))
        elif "add" in action:
            added.append(str(root / unquote(action["add"]["path"])))
        elif "commitInfo" in action:
            info = action["commitInfo"]
    return removed, added, info


def key_column_floor(paths: list[str]) -> tuple[float, int]:
    """Seconds to read the key column of each file with pyarrow (one after another), and the rows read."""
    rows = 0
    start = time.perf_counter()
    for path in paths:
        rows += pq.read_table(path, columns=[KEY]).num_rows
    return time.perf_counter() - start, rows


def deltalake_version() -> str:
    import deltalake

    return deltalake.__version__


def peak_rss_of(fn: Any) -> tuple[float, Any, tuple[int, int]]:
    """(seconds, result, (RSS of this process when the call began, its peak during the call)): VmHWM reset before
    it. The process also holds the benchmark's own key model and the open caches, hence the figure at the start."""
    try:
        _report.reset_peak_rss()
    except OSError:
        pass
    rss = _report.rss_bytes()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result, (rss, _report.status_bytes("VmHWM"))


def check(root: Path, keys: Keys) -> tuple[str, bool, dict[str, Any]]:
    """verify_table, and the rows QueryBuilder and read_arrow read against the keys written."""
    from deltalake import DeltaTable, QueryBuilder

    start = time.perf_counter()
    verified = verify_table(Table.open(str(root)))
    verify_s = time.perf_counter() - start
    out = (
        QueryBuilder()
        .register("t", DeltaTable(str(root)))
        .execute(f"select count(*) as n, count(distinct {KEY}) as d, sum(v) as s from t")
        .read_all()
    )
    delta = pa.table(out).to_pylist()[0]
    ours = reads.read_arrow(Table.open(str(root)), columns=[KEY]).num_rows
    expected = {"rows": len(keys), "sum_v": int(keys.v.sum())}
    ok = (
        verified.ok
        and delta["n"] == delta["d"] == ours == expected["rows"]
        and int(delta["s"] or 0) == expected["sum_v"]
    )
    line = (
        f"Check: `verify_table` {'ok' if verified.ok else 'FAILED: ' + str(verified.damaged[:3])} "
        f"({verify_s:.1f} s); deltalake QueryBuilder reads {delta['n']:,} rows ({delta['d']:,} distinct ids, "
        f"sum(v) {int(delta['s'] or 0):,}), dbidx `read_arrow` {ours:,} rows; expected {expected['rows']:,} "
        f"distinct keys, sum(v) {expected['sum_v']:,}: {'check ok' if ok else 'MISMATCH'}."
    )
    figures = {
        "verify_ok": verified.ok,
        "verify_s": verify_s,
        "querybuilder_rows": delta["n"],
        "querybuilder_distinct": delta["d"],
        "read_arrow_rows": ours,
        "expected_rows": expected["rows"],
        "ok": ok,
    }
    return line, ok, figures


def run(args: argparse.Namespace, work: Path) -> tuple[str, bool, dict[str, Any]]:
    from deltalake import DeltaTable

    root, caches = work / "absorb-table", work / "absorb-cache"
    for path in (root, caches):
        shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    keys = Keys(args.keys, args.days, rng)
    log(f"{args.keys:,} keys generated in {time.perf_counter() - start:.1f} s")
    table = Table.open_or_create(str(root), num_shards=args.shards)
    config = CacheConfig(base_path=str(caches))

    # 1. The build, then steady batches (deletion vectors).
    build: list[float] = []
    for number, lo in enumerate(range(0, args.keys, args.build_batch), start=1):
        idx = np.arange(lo, min(lo + args.build_batch, args.keys))
        seconds, _ = upsert(keys.rows(idx, 0), table, config)
        build.append(seconds)
        log(f"build batch {number}: {len(idx):,} rows in {seconds:.2f} s")
    value = 0
    before = []
    for _ in range(STEADY_BEFORE):
        value += 1
        before.append(upsert(keys.steady(args.steady_rows, value), table, config))
        log(f"steady batch {value} (before the OPTIMIZE): {before[-1][0]:.3f} s")
    delta_files_before = len(DeltaTable(str(root)).file_uris())

    # 2. Another engine's OPTIMIZE.
    compact_s, metrics, compact_rss = peak_rss_of(lambda: DeltaTable(str(root)).optimize.compact())
    version = DeltaTable(str(root)).version()
    removed, added, info = version_files(root, version)
    log(
        f"delta-rs optimize.compact: {compact_s:.2f} s, version {version}, {len(removed):,} files removed, "
        f"{len(added):,} added"
    )

    # 3. dbidx absorbs it.
    absorb_s, records, absorb_rss = peak_rss_of(lambda: Table.open(str(root)).absorb_delta_log())
    if not records:
        raise SystemExit(f"absorb_delta_log published nothing for Delta version {version}")
    record = records[-1]
    entries = sum(f.rows for f in record.files)
    inserts = sum(f.inserts for f in record.files)
    tombstones = sum(f.tombstones for f in record.files)
    log(
        f"dbidx absorb: {absorb_s:.2f} s, {len(record.replaced):,} files removed, {len(record.data_files):,} added, "
        f"{entries:,} index entries"
    )

    # 4. The floor: the key column of the touched files.
    anchor_s, anchor_rows = key_column_floor(removed + added)
    log(
        f"pyarrow key-column read of the {len(removed) + len(added):,} touched files: {anchor_s:.2f} s "
        f"({anchor_rows:,} rows)"
    )

    # 5. Steady batches after the absorb (the writer's own long-lived Table, the same caches).
    after = []
    for _ in range(STEADY_AFTER):
        value += 1
        after.append(upsert(keys.steady(args.steady_rows, value), table, config))
        log(f"steady batch {value} (after the absorb): {after[-1][0]:.3f} s")

    line, ok, checked = check(root, keys)
    log(line)
    figures = {
        "keys": args.keys,
        "days": args.days,
        "shards": args.shards,
        "build_batch": args.build_batch,
        "steady_rows": args.steady_rows,
        "build_s": sum(build),
        "build_batch_s": build,
        "steady_before_s": [s for s, _ in before],
        "steady_after_s": [s for s, _ in after],
        "summaries": [{k: v for k, v in m.items() if k not in ("partitions", "per_shard")} for _, m in before + after],
        "delta_files_before": delta_files_before,
        "compact_s": compact_s,
        "compact_rss": compact_rss,
        "compact_metrics": metrics,
        "delta_version": version,
        "delta_operation": info.get("operation"),
        "delta_removed": len(removed),
        "delta_added": len(added),
        "absorb_s": absorb_s,
        "absorb_rss": absorb_rss,
        "absorb_records": len(records),
        "absorb_removed": len(record.replaced),
        "absorb_added": len(record.data_files),
        "absorb_entries": entries,
        "absorb_inserts": inserts,
        "absorb_tombstones": tombstones,
        "absorb_index_files": len(record.files),
        "anchor_s": anchor_s,
        "anchor_rows": anchor_rows,
        "check": checked,
    }
    body = render(args, figures, before, after, line)
    return body, ok, figures


# ---------------------------------------------------------------------------------------------------------------
# The report.


def rss(pair: tuple[int, int]) -> str:
    """A step's memory: this process's peak RSS during it, and its RSS when it began."""
    return f"peak RSS of the process {pair[1] / MIB:,.0f} MiB ({pair[0] / MIB:,.0f} MiB when the step began)"


def render(
    args: argparse.Namespace,
    f: dict[str, Any],
    before: list[tuple[float, dict[str, Any]]],
    after: list[tuple[float, dict[str, Any]]],
    check_line: str,
) -> str:
    steady_before = statistics.median(f["steady_before_s"])
    touched = f["delta_removed"] + f["delta_added"]
    rows = [
        [
            f"dbidx build: {args.keys:,} keys, {len(f['build_batch_s'])} upsert_arrow batches of "
            f"{args.build_batch:,} (the first on the bulk path)",
            f"{f['build_s']:.1f} s",
            f"{args.keys / f['build_s']:,.0f} keys/s",
            "-",
        ],
        [
            f"dbidx steady batch before the OPTIMIZE ({args.steady_rows:,} rows, median of {STEADY_BEFORE})",
            f"{steady_before:.3f} s",
            "-",
            "-",
        ],
        [
            f"delta-rs `optimize.compact()` (the other engine): {f['delta_files_before']:,} live files before, "
            f"{f['delta_removed']:,} removed, {f['delta_added']:,} added; {rss(f['compact_rss'])}",
            f"{f['compact_s']:.2f} s",
            "-",
            "-",
        ],
        [
            f"dbidx absorb of that version (`Table.open(..).absorb_delta_log()`): {f['absorb_removed']:,} files "
            f"removed, {f['absorb_added']:,} added, {f['absorb_entries']:,} index entries ({f['absorb_inserts']:,} "
            f"keys re-pointed or new, {f['absorb_tombstones']:,} tombstones) in {f['absorb_index_files']:,} index files; "
            f"{rss(f['absorb_rss'])}",
            f"{f['absorb_s']:.2f} s",
            f"pyarrow key-column read of the {touched:,} touched files ({f['anchor_rows']:,} rows): "
            f"{f['anchor_s']:.2f} s",
            f"{f['absorb_s'] / f['anchor_s']:.2f}x",
        ],
        [
            "dbidx absorb vs the other engine's OPTIMIZE",
            f"{f['absorb_s']:.2f} s",
            f"delta-rs compact {f['compact_s']:.2f} s",
            f"{f['absorb_s'] / f['compact_s']:.2f}x",
        ],
    ]
    for i, (seconds, _) in enumerate(after, start=1):
        label = "first" if i == 1 else "second" if i == 2 else f"#{i}"
        rows.append(
            [
                f"dbidx {label} steady batch after the absorb ({args.steady_rows:,} rows)",
                f"{seconds:.3f} s",
                f"steady before the OPTIMIZE {steady_before:.3f} s",
                f"{seconds / steady_before:.2f}x",
            ]
        )
    batch_rows = []
    for i, (seconds, summary) in enumerate(before, start=1):
        batch_rows.append([f"before the OPTIMIZE, {i}", f"{seconds:.3f}"] + summary_cells(summary))
    for i, (seconds, summary) in enumerate(after, start=1):
        batch_rows.append([f"after the absorb, {i}", f"{seconds:.3f}"] + summary_cells(summary))
    return "\n\n".join(
        [
            f"## Absorbing another engine's OPTIMIZE: {args.keys:,} keys",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. No Spark: dbidx writes through "
            f"`upsert_arrow` in this process ({args.shards} key shards, one cache base path for every upsert), "
            f"{args.keys:,} UUID keys over {args.days} daily partitions (each key's day at random), columns id, dt, v. "
            f"Steady batches: {args.steady_rows:,} rows, {UPDATE_SHARE:.0%} updates of existing keys at random "
            f"(any day), the rest new keys. Then delta-rs {deltalake_version()} compacts the table "
            f"(Delta version {f['delta_version']}, operation {f['delta_operation']}), and a Table opened for it absorbs "
            "that version (docs/FORMAT.md section 12c: it reads the key column of the removed files minus their "
            "deletion vectors and of the added files, and re-points every key to its new file). The anchor is the floor "
            "the absorb cannot go under: `pyarrow.parquet.read_table(path, columns=['id'])` of each touched file, one "
            "after another, in the same run (page cache warm for both: the compaction just read and wrote them). "
            "One run per row.",
            _report.table(["step", "seconds", "anchor", "ratio"], rows),
            check_line,
            "Steady batches, from the upsert's summary (catch-up entries: index entries the caches applied before "
            "tagging; the first batch after the absorb pays for the re-pointed keys):",
            _report.table(["batch", "dbidx s"] + CELL_HEADERS, batch_rows),
        ]
    )


# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=30, help="daily partitions")
    parser.add_argument("--shards", type=int, default=2, help="dbidx key shards")
    parser.add_argument(
        "--work",
        type=Path,
        help="where the table and caches go (default: a temp dir under the "
        "current directory); removed at the end either way",
    )
    parser.add_argument("--smoke", action="store_true", help="20,000 keys (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    args.build_batch, args.steady_rows = BUILD_BATCH, STEADY_ROWS
    if args.smoke:
        args.keys, args.build_batch, args.steady_rows = 20_000, 10_000, 2_000
    if args.keys < args.steady_rows or args.days < 1 or args.shards < 1:
        parser.error("--keys must be at least the steady batch's rows, --days and --shards at least 1")
    own = args.work is None
    work = Path(tempfile.mkdtemp(prefix="dbidx-absorb-bench-", dir=str(Path.cwd()))) if own else args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        body, ok, figures = run(args, work)
    finally:
        for name in ("absorb-table", "absorb-cache"):
            shutil.rmtree(work / name, ignore_errors=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)
    if not ok:  # figures measured on a broken table are not published
        print(body)
        raise SystemExit("the check failed (see the check line)")
    if args.write_results and not args.smoke:
        body = _report.publish("absorb", body, figures)
    print(body)


if __name__ == "__main__":
    main()
