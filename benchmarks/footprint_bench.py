"""Disk footprint benchmark (the headline): bytes per index entry of the index Parquet files, the RocksDB cache and a
Python dict, for realistic key shapes and partition counts; the cache under snappy / lz4 / zstd before and after
compaction; and the cache's growth over 30 simulated days with the TTL reaper on vs off.

Key shapes: UUID strings, 20-digit numeric ids (sequential), composite `tenant-<3>|order-<12>` keys. File groups
as dynamic buckets write them (`<bucket:08d>-<24 hex>`, ~100 k keys each, at least one per partition).
Cache B/entry = the whole shard directory (SST files plus RocksDB's fixed files) / entries, one shard.
Run: `python benchmarks/footprint_bench.py [--sizes 1000000,10000000] [--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from bootstrap_bench import uuid_keys
from cache_bench import load_cache, rss_of, seq_keys

from dbidx.buckets.naming import file_group_id
from dbidx.cache.loading import snapshot_entries
from dbidx.cache.reaper import reap
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.registry import CacheIdentity
from dbidx.config import CacheConfig
from dbidx.table.facade import Table

SHAPES = ("uuid", "numeric20", "composite")
RFC107 = "RFC-107 estimate: 50-70 B/entry in the index, RocksDB about 2x the HFile (~100-140 B/entry)"
DAY_MS = 86_400_000


def make_keys(shape: str, start: int, n: int, rng: np.random.Generator) -> pa.Array:
    """n keys of a shape; numeric and composite keys are sequential from `start` (ids as databases hand them out)."""
    if shape == "uuid":
        return uuid_keys(n, rng)
    if shape == "numeric20":
        return seq_keys(10**15 + start, n)
    ids = np.arange(start, start + n)
    tenants = np.char.zfill((ids % 997).astype(str), 3)
    orders = np.char.zfill(ids.astype(str), 12)
    return pa.array(np.char.add(np.char.add(np.char.add("tenant-", tenants), "|order-"), orders).tolist())


def build_table(root: Path, shape: str, entries: int, partitions: int, rng: np.random.Generator) -> Table:
    """One commit per partition, file groups of ~100 k keys as dynamic buckets name them."""
    table = Table.create(str(root / f"t-{shape}-{entries}-{partitions}"), num_shards=1)
    per = entries // partitions
    for p in range(partitions):
        part = f"dt={np.datetime64('2024-01-01') + p}"
        keys = make_keys(shape, p * per, per, rng)
        groups = max(1, per // 100_000)
        names = np.array([file_group_id(table.props.table_id, part, g) for g in range(groups)], dtype=object)
        with table.new_commit() as writer:
            writer.insert(part, keys, pa.array(names[np.arange(per) % groups].tolist(), pa.string()))
    return table


def index_bytes(table: Table) -> int:
    return _report.dir_bytes(Path(table.uri) / ".dbidx", "*.parquet")


def dict_rss(table: Table) -> int:
    """Peak RSS growth of a fresh interpreter that holds the whole index in a dict {key: file group}."""
    base = rss_of("from dbidx.table.facade import Table\n")
    full = rss_of(
        "from dbidx.table.facade import Table\n"
        f"t = Table.open({table.uri!r})\n"
        "m = {}\n"
        "for s in t.partitions():\n"
        "    snap = t.snapshot(s.partition)\n"
        "    m.update(zip(snap.column('key').to_pylist(), snap.column('file_group').to_pylist()))\n"
        "    del snap\n"
    )
    return full - base


def bulk_loaded_size(table: Table, path: Path, config: CacheConfig) -> tuple[int, int]:
    """(disk bytes, entries) of a cache holding every partition as bootstrap loads it (bulk SST ingest)."""
    cache, entries = load_cache(table, path, config, [s.partition for s in table.partitions()])
    try:
        return cache.disk_bytes(), entries
    finally:
        cache.close()
        shutil.rmtree(path, ignore_errors=True)


def incremental_cache(table: Table, path: Path, config: CacheConfig) -> tuple[RecordIndexCache, int]:
    """A cache filled the way catch-up fills it (batched puts of 100 k, memtable flushes), not bulk-loaded."""
    shutil.rmtree(path, ignore_errors=True)
    cache = RecordIndexCache(path, CacheIdentity(table.props.table_id, 1, 0, "partitioned"), config).open()
    seq = table.timeline.latest_seq
    entries = 0
    for stats in table.partitions():
        keys, locations = snapshot_entries(table, 0, stats.partition, seq, False)
        cache.load_partition(stats.partition, [], [], seq)  # an empty, ready partition
        for start in range(0, len(keys), 100_000):
            chunk = slice(start, start + 100_000)
            cache.apply(stats.partition, keys[chunk], locations[chunk].to_pylist(), [False] * len(keys[chunk]), seq)
        entries += len(keys)
    cache.flush()
    return cache, entries


def compact_all(cache: RecordIndexCache) -> None:
    for state in cache.partitions().values():
        view = cache.store.cf(state.cf)  # type: ignore[union-attr]
        view.compact_range(None, None)
        del view  # rocksdict keeps the DB's LOCK while any column family view is alive


def ttl_growth(work: Path, keys_per_day: int, days: int, ttl_days: int) -> list[list]:
    """Cache bytes per day over `days` days of daily partitions (batches touch the last 3 days), TTL on vs off."""
    rng = np.random.default_rng(11)
    table = Table.create(str(work / "ttl-table"), num_shards=1)
    caches = {
        on: RecordIndexCache.for_table(
            table, 0, CacheConfig(partition_ttl_hours=ttl_days * 24.0), base_path=work / f"ttl-{on}"
        ).open()
        for on in (True, False)
    }
    rows = []
    try:
        for day in range(days):
            part = f"dt={np.datetime64('2025-01-01') + day}"
            with table.new_commit() as writer:
                writer.insert(part, uuid_keys(keys_per_day, rng), file_group_id(table.props.table_id, part, 0))
            now = (20_000 + day) * DAY_MS  # simulated clock
            seq = table.timeline.latest_seq
            for on, cache in caches.items():
                keys, locations = snapshot_entries(table, 0, part, seq, False)
                cache.load_partition(part, keys, locations, seq)
                for back in range(min(3, day + 1)):  # today's batch touches the last three days
                    cache.touch(f"dt={np.datetime64('2025-01-01') + day - back}", at_ms=now)
                if on:
                    reap(cache, now_ms=now)
                cache.flush()
            rows.append(
                [
                    day + 1,
                    (day + 1) * keys_per_day,
                    caches[True].disk_bytes() / 2**20,
                    caches[False].disk_bytes() / 2**20,
                    len(caches[True].partitions()),
                ]
            )
    finally:
        for cache in caches.values():
            cache.close()
    return rows


def summary_line(headline: list[list]) -> str:
    """The headline in one computed sentence (nothing typed by hand)."""
    largest = max(r[1] for r in headline)
    rows = [r for r in headline if r[1] >= largest * 0.99]  # the largest size (entries round down per partition)
    worst = max(rows, key=lambda r: r[4])
    best = min(rows, key=lambda r: r[4])
    return (
        f"At {largest:,} entries the cache takes {best[4]:.1f} B/entry ({best[0]}, {best[2]} partitions) to "
        f"{worst[4]:.1f} B/entry ({worst[0]}, {worst[2]} partitions), {min(r[5] for r in rows):.1f}x to "
        f"{max(r[5] for r in rows):.1f}x the index's Parquet bytes."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--partitions", default="1,30,365")
    parser.add_argument("--ttl-days", type=int, default=7)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.partitions, args.days = "20000", "1,3", 4
    sizes = [int(s) for s in args.sizes.split(",")]
    partition_counts = [int(p) for p in args.partitions.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dbidx-footprint-", dir=str(Path.cwd())))
    rng = np.random.default_rng(1)
    headline, compression, dicts, started = [], [], {}, time.perf_counter()
    try:
        for size in sizes:
            for shape in SHAPES:
                for parts in partition_counts:
                    # 1. The index as upserts write it and the cache as bootstrap loads it (bulk ingest, zstd).
                    table = build_table(work, shape, size, parts, rng)
                    n = sum(s.live_keys for s in table.partitions())
                    disk, entries = bulk_loaded_size(table, work / "cache", CacheConfig())
                    index = index_bytes(table)
                    headline.append([shape, n, parts, index / n, disk / entries, disk / index])
                    middle = partition_counts[len(partition_counts) // 2]
                    if parts == middle:
                        dicts[(shape, size)] = dict_rss(table) / n
                        # 2. Compressions: bulk-loaded (the default codec's is the headline's), and as catch-up
                        #    writes before and after a full compaction.
                        bulk = {CacheConfig().compression: disk / entries}
                        for codec in ("snappy", "lz4", "zstd"):
                            config = replace(CacheConfig(), compression=codec)
                            if codec not in bulk:
                                codec_disk, codec_entries = bulk_loaded_size(table, work / "bulk", config)
                                bulk[codec] = codec_disk / codec_entries
                            cache, entries = incremental_cache(table, work / "inc", config)
                            before = cache.disk_bytes() / entries
                            compact_all(cache)
                            compression.append(
                                [
                                    shape,
                                    entries,
                                    codec,
                                    bulk[codec],
                                    before,
                                    cache.disk_bytes() / entries,
                                    index_bytes(table) / n,
                                ]
                            )
                            cache.close()
                            shutil.rmtree(work / "inc", ignore_errors=True)
                    shutil.rmtree(table.uri, ignore_errors=True)
        # 3. Growth over simulated days, TTL reaper on vs off.
        growth = ttl_growth(work, max(1_000, sizes[0] // 30), args.days, args.ttl_days)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    dict_rows = [
        [shape, size, dicts[(shape, size)], dicts[(shape, size)] * size / 2**20]
        for size in sizes
        for shape in SHAPES
        if (shape, size) in dicts
    ]
    body = "\n\n".join(
        [
            "## Disk footprint",
            f"Machine: {_report.machine()}. Command: `{_report.command()}` ({time.perf_counter() - started:,.0f} s). "
            "One shard; cache = bulk-loaded SSTs (what bootstrap and on-demand loads write), zstd, 16 KB blocks, "
            "bloom 10 bits/key; index = the RLI Parquet files; dict = RSS growth of a process holding {key: file group}.",
            _report.table(
                ["key shape", "entries", "partitions", "index Parquet B/entry", "cache B/entry", "cache / index"],
                headline,
            ),
            f"{RFC107}. {summary_line(headline)}",
            _report.table(["key shape", "entries", "dict B/entry", "dict MB"], dict_rows),
            f"Compression, over {partition_counts[len(partition_counts) // 2]} partitions: the cache bulk-loaded (as "
            "bootstrap and on-demand loads write it: sorted SSTs ingested at the bottom level), and filled by catch-up "
            "writes (batched puts, memtable flushes) before and after a full compaction.",
            _report.table(
                [
                    "key shape",
                    "entries",
                    "compression",
                    "bulk-loaded B/entry",
                    "catch-up written B/entry, before compaction",
                    "after compaction",
                    "index Parquet B/entry",
                ],
                compression,
            ),
            f"Growth over {args.days} simulated days ({max(1_000, sizes[0] // 30):,} new UUID keys a day, each batch "
            f"touching the last 3 days), TTL {args.ttl_days} days: bounded with the reaper, growing without it.",
            _report.table(
                ["day", "keys in the index", "cache MB (TTL on)", "cache MB (TTL off)", "partitions cached (TTL on)"],
                growth,
            ),
        ]
    )
    if args.write_results and not args.smoke:
        body = _report.publish(
            "footprint", body, {"headline": headline, "dict": dict_rows, "compression": compression, "growth": growth}
        )
    print(body)


if __name__ == "__main__":
    main()
