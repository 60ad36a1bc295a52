"""The end-to-end demo behind `make demo` / `dbidx demo`.

Until the Spark integration lands it runs the index and cache halves of the pipeline without Spark: write a
hive-partitioned Parquet data set, build its index, bootstrap one RocksDB cache per key shard with the last two
days and load older partitions on demand, commit two upsert
batches (new keys staged in the caches' in-flight overlay first, deletes, a re-insert), catch the caches up,
compact and clean (the caches reload what was cleaned), verify every cache against the index, and look keys up
in both. Each step checks its result and fails loudly on a wrong answer.
"""
from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from dbidx.bootstrap.on_demand import ensure_loaded
from dbidx.bootstrap.time_bounded import bootstrap_caches
from dbidx.cache import catchup
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.verify import verify
from dbidx.config import CacheConfig
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
    say(f"[1/7] wrote {days} days x {keys_per_day} records of Parquet under {root}")
    # 2. Migration: build the index from the data files.
    table = Table.create(str(root), num_shards=4)
    built = build_index(table, "id", ["dt"])
    report["build_index"] = {"keys": built.keys, "files": built.files, "seconds": round(time.perf_counter() - t0, 3)}
    say(f"[2/7] build-index: {built.keys} keys from {built.files} files in {built.partitions} partitions")
    # 3. One executor-local cache per key shard, loaded from the index.
    t2 = time.perf_counter()
    caches = [RecordIndexCache.for_table(table, shard, CacheConfig(), base_path=root / "_cache").open()
              for shard in range(table.num_shards)]
    try:
        booted = bootstrap_caches(caches, table, days=2, now=day_names[-1])
        older = [s.partition for s in table.partitions() if not caches[0].is_ready(s.partition)]
        stalls = [ensure_loaded(c, table, older) for c in caches]
        loaded = booted.entries + sum(r.entries for r in stalls)
        report["cache_load"] = {"bootstrap_entries": booted.entries, "bootstrap_seconds": round(booted.seconds, 3),
                                "on_demand_partitions": len(older), "on_demand_entries": loaded - booted.entries,
                                "on_demand_stall_seconds": round(max(r.stall_seconds for r in stalls), 3),
                                "entries": loaded, "seconds": round(time.perf_counter() - t2, 3),
                                "disk_bytes": sum(c.disk_bytes() for c in caches)}
        say(f"[3/7] bootstrap of the last 2 days: {booted.entries} entries into {len(caches)} shard caches under "
            f"{root / '_cache'} in {booted.seconds:.2f} s; then {len(older)} older partitions loaded on demand, "
            f"concurrently (stall {report['cache_load']['on_demand_stall_seconds']} s per shard); "
            f"{report['cache_load']['disk_bytes']} bytes on disk")
        _upserts_and_checks(table, caches, day_names, keys_per_day, days, report, say)
    finally:
        for c in caches:
            c.close()
    # 7. Warm restart: reopen the caches, catch up only (no reload), and verify them again.
    t3 = time.perf_counter()
    for shard in range(table.num_shards):
        with RecordIndexCache.for_table(table, shard, base_path=root / "_cache") as cache:
            synced = catchup.sync(cache, table)
            if synced.reloaded_partitions or not verify(cache, table).ok:
                raise DbidxError(f"demo check failed: warm restart of shard {shard} was not a clean catch-up")
    report["warm_restart_seconds"] = round(time.perf_counter() - t3, 3)
    stats = table.partitions()
    report["partitions"] = {s.partition: s.live_keys for s in stats}
    report["live_keys"] = sum(s.live_keys for s in stats)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    say(f"[7/7] warm restart of {table.num_shards} caches (catch-up, verify) in {report['warm_restart_seconds']} s; "
        f"{report['live_keys']} live keys in {len(stats)} partitions; demo finished in {report['seconds']} s")
    return report


def _upserts_and_checks(table: Table, caches: list[RecordIndexCache], day_names: list[str], keys_per_day: int,
                        days: int, report: dict[str, Any], say: Callable[[str], None]) -> None:
    """Steps 4-6: upserts through the overlay, compaction with reloads, verify and lookups."""
    # 4. Two upsert batches: new keys for a new day, deletes, and a re-insert after delete.
    new_day = f"dt=2025-01-{days + 1:02d}"
    fresh = [f"order-{days:02d}-{i:07d}" for i in range(keys_per_day // 10)]
    file_group = f"00000000-{uuid.uuid4().hex[:12]}"
    with table.new_commit() as w:
        # Tagging assigns the new keys a file group and stages them in their shard's overlay before the commit.
        for shard, cache in enumerate(caches):
            mine = [k for k, s in zip(fresh, table.shard_of(fresh)) if s == shard]
            cache.load_partition(new_day, [], [], synced_seq=table.timeline.latest_seq)
            cache.put_pending(w.instant, new_day, mine, [file_group] * len(mine))
        w.insert(new_day, fresh, file_group)
        deleted = w.delete(f"dt={day_names[0]}", [f"order-00-{i:07d}" for i in range(100)])
        instant = w.instant
    with table.new_commit() as w:
        w.insert(f"dt={day_names[0]}", ["order-00-0000000"], f"00000001-{uuid.uuid4().hex[:12]}")
    applied = sum(catchup.commit(c, table, instant).applied_entries for c in caches)
    say(f"[4/7] committed {len(fresh)} inserts into {new_day}, {deleted} deletes, 1 re-insert after delete; "
        f"caches applied {applied} entries")
    # 5. Compaction merges the deltas and the clean removes them: answers must not change; caches reload.
    before = table.snapshot(f"dt={day_names[0]}").num_rows
    result = compact(table, min_files=2)
    clean(table, retain_completions=0)
    after = table.snapshot(f"dt={day_names[0]}").num_rows
    if before != after:
        raise DbidxError(f"demo check failed: compaction changed dt={day_names[0]} from {before} to {after} keys")
    with table.new_commit() as w:
        w.insert(f"dt={day_names[1]}", ["late-arrival"], f"00000002-{uuid.uuid4().hex[:12]}")
    synced = [catchup.sync(c, table) for c in caches]
    mismatches = [i for i, c in enumerate(caches) if not verify(c, table).ok]
    if mismatches:
        raise DbidxError(f"demo check failed: caches of shards {mismatches} differ from the index")
    say(f"[5/7] compacted {result.groups} (partition, shard) groups; dt={day_names[0]} still has {after} keys; caches "
        f"caught up ({sum(len(r.reloaded_partitions) for r in synced)} partition reloads) and verified")
    # 6. Lookups: an existing key, a deleted key, the re-inserted key, a brand-new key: index and cache agree.
    probe = ["order-00-0000000", "order-00-0000001", "order-00-0000500", "never-seen"]
    partition = f"dt={day_names[0]}"
    t1 = time.perf_counter()
    found = table.lookup(probe, partition).to_pylist()
    report["lookup_ms"] = round((time.perf_counter() - t1) * 1000, 2)
    located = {row["key"]: row["file_group"] for row in found}
    expected = {"order-00-0000000", "order-00-0000500"}
    if set(located) != expected:
        raise DbidxError(f"demo check failed: lookup found {sorted(located)}, expected {sorted(expected)}")
    t2 = time.perf_counter()
    from_cache = {k: caches[int(s)].lookup(partition, [k])[0] for k, s in zip(probe, table.shard_of(probe))}
    report["cache_lookup_ms"] = round((time.perf_counter() - t2) * 1000, 2)
    if {k: v for k, v in from_cache.items() if v is not None} != located:
        raise DbidxError(f"demo check failed: cache answered {from_cache}, index {located}")
    for key in probe:
        say(f"      {key:<18} -> {located.get(key, 'new key (not in index)')}")
    say(f"[6/7] index lookup {report['lookup_ms']} ms, cache lookup {report['cache_lookup_ms']} ms, same answers")
