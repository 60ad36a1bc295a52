"""The end-to-end demo behind `make demo` / `dbidx demo`.

Until the Spark integration lands it runs the persisted-index half of the pipeline with pyarrow only: write a
hive-partitioned Parquet data set, build its index, commit two upsert batches (new keys, deletes, a re-insert),
compact, and look keys up, checking at each step that every key has exactly one location.
"""
from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from dbidx.errors import DbidxError
from dbidx.mdt.build_index import build_index
from dbidx.mdt.compaction import clean, compact
from dbidx.mdt.table import Table

Echo = Callable[[str], None] | None


def _write_day(root: Path, day: str, keys: list[str]) -> None:
    """One day's data as two Parquet files, the way a Spark job would leave it."""
    part = root / f"dt={day}"
    part.mkdir(parents=True, exist_ok=True)
    half = len(keys) // 2
    for i, chunk in enumerate((keys[:half], keys[half:])):
        data = pa.table({"id": chunk, "amount": list(range(len(chunk)))})
        pq.write_table(data, part / f"part-{i:05d}-{uuid.uuid4()}-c000.snappy.parquet")


def run_demo(workdir: str, keys_per_day: int = 50_000, days: int = 5, echo: Echo = print) -> dict[str, Any]:
    """Run the demo in `workdir` (recreated) and return a report of what happened and how long it took."""
    say = echo or (lambda _msg: None)
    root = Path(workdir).resolve()
    if root.exists():
        if not (root / ".dbidx").exists() and any(root.iterdir()):
            raise DbidxError(f"demo directory {root} exists and is not a dbidx demo table; pick another --dir")
        shutil.rmtree(root)
    report: dict[str, Any] = {"dir": str(root)}
    # 1. A data set the index does not know yet.
    t0 = time.perf_counter()
    day_names = [f"2025-01-{d + 1:02d}" for d in range(days)]
    for d, day in enumerate(day_names):
        _write_day(root, day, [f"order-{d:02d}-{i:07d}" for i in range(keys_per_day)])
    say(f"[1/5] wrote {days} days x {keys_per_day} records of Parquet under {root}")
    # 2. Migration: build the index from the data files.
    table = Table.create(str(root), num_shards=4)
    built = build_index(table, "id", ["dt"])
    report["build_index"] = {"keys": built.keys, "files": built.files, "seconds": round(time.perf_counter() - t0, 3)}
    say(f"[2/5] build-index: {built.keys} keys from {built.files} files in {built.partitions} partitions")
    # 3. Two upsert batches: new keys for a new day, deletes, and a re-insert after delete.
    new_day = f"2025-01-{days + 1:02d}"
    fresh = [f"order-{days:02d}-{i:07d}" for i in range(keys_per_day // 10)]
    with table.new_commit() as w:
        w.insert(f"dt={new_day}", fresh, f"00000000-{uuid.uuid4().hex[:12]}")
        deleted = w.delete(f"dt={day_names[0]}", [f"order-00-{i:07d}" for i in range(100)])
    with table.new_commit() as w:
        w.insert(f"dt={day_names[0]}", ["order-00-0000000"], f"00000001-{uuid.uuid4().hex[:12]}")
    say(f"[3/5] committed {len(fresh)} inserts into dt={new_day}, {deleted} deletes, 1 re-insert after delete")
    # 4. Compaction merges the deltas; answers must not change.
    before = table.snapshot(f"dt={day_names[0]}").num_rows
    result = compact(table, min_files=2)
    clean(table, retain_completions=0)
    after = table.snapshot(f"dt={day_names[0]}").num_rows
    if before != after:
        raise DbidxError(f"demo check failed: compaction changed dt={day_names[0]} from {before} to {after} keys")
    say(f"[4/5] compacted {result.groups} (partition, shard) groups; dt={day_names[0]} still has {after} keys")
    # 5. Lookups: an existing key, a deleted key, the re-inserted key, a brand-new key.
    probe = ["order-00-0000000", "order-00-0000001", "order-00-0000500", "never-seen"]
    t1 = time.perf_counter()
    found = table.lookup(probe, f"dt={day_names[0]}").to_pylist()
    report["lookup_ms"] = round((time.perf_counter() - t1) * 1000, 2)
    located = {row["key"]: row["file_group"] for row in found}
    expected = {"order-00-0000000", "order-00-0000500"}
    if set(located) != expected:
        raise DbidxError(f"demo check failed: lookup found {sorted(located)}, expected {sorted(expected)}")
    for key in probe:
        say(f"      {key:<18} -> {located.get(key, 'new key (not in index)')}")
    stats = table.partitions()
    report["partitions"] = {s.partition: s.live_keys for s in stats}
    report["live_keys"] = sum(s.live_keys for s in stats)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    say(f"[5/5] {report['live_keys']} live keys in {len(stats)} partitions; demo finished in {report['seconds']} s")
    return report
