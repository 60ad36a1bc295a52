"""Cache benchmark: on-disk bytes per entry (per key shape, compression and block size) against the index's Parquet,
batched lookup rate against raw rocksdict multi-get, and process RSS against a Python dict of the same map.

Data: `--entries` entries over `--partitions` partitions (default 10 M over 30), once with random UUID-string keys
and once with 20-digit sequential ids; file groups of ~100 k keys. The headline (zstd, 16 KB blocks) uses every
entry; the compression x block-size grid uses the first `--grid-partitions` partitions (stated in the table).
Run: `python benchmarks/cache_bench.py [--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from bootstrap_bench import uuid_keys

from dbidx.cache import codec
from dbidx.cache.loading import snapshot_entries
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.registry import CacheIdentity
from dbidx.cache.store import MULTI_GET_CHUNK, multi_get
from dbidx.config import CacheConfig
from dbidx.table.facade import Table


def seq_keys(start: int, n: int) -> pa.Array:
    """n 20-digit zero-padded sequential ids from `start`."""
    return pa.array(np.char.zfill(np.arange(start, start + n).astype(str), 20).tolist(), pa.string())


def build_table(root: Path, shape: str, entries: int, partitions: int) -> Table:
    """One commit per partition; file groups of ~100 k keys."""
    table = Table.create(str(root / f"table-{shape}"), num_shards=1)
    rng = np.random.default_rng(3)
    per = entries // partitions
    for p in range(partitions):
        keys = uuid_keys(per, rng) if shape == "uuid" else seq_keys(10**15 + p * per, per)
        groups = max(1, per // 100_000)
        fgs = pa.array([f"{g:08d}-{p:08x}" for g in range(groups)]).take(pa.array(np.arange(per) % groups))
        with table.new_commit() as w:
            w.insert(f"dt=2025-01-{p % 28 + 1:02d}/h={p // 28}", keys, fgs)
    return table


def load_cache(table: Table, path: Path, config: CacheConfig, partitions: list[str]) -> tuple[RecordIndexCache, int]:
    """A cache holding the given partitions (bulk-loaded SSTs land in the bottom level); (open cache, entries)."""
    shutil.rmtree(path, ignore_errors=True)
    cache = RecordIndexCache(path, CacheIdentity(table.props.table_id, 1, 0, "partitioned"), config).open()
    seq = table.timeline.latest_seq
    entries = 0
    for partition in partitions:
        keys, locations = snapshot_entries(table, 0, partition, seq, False)
        cache.load_partition(partition, keys, locations, seq)
        entries += len(keys)
    cache.flush()
    return cache, entries


def measure_lookups(
    table: Table, cache: RecordIndexCache, shape: str, partition: str, size: int, repeats: int
) -> tuple[list[object], list[str]]:
    """One warm partition, a batch of `size` keys (80 % present): ([shape, batch, cache keys/s, raw multi-get
    keys/s, cache / raw], the batch's keys). Medians of `repeats`, after one untimed lookup."""
    present = table.snapshot(partition).column("key").to_pylist()
    rng = np.random.default_rng(5)
    n_present = int(size * 0.8)
    absent = (
        uuid_keys(size - n_present, rng).to_pylist()
        if shape == "uuid"
        else seq_keys(10**18, size - n_present).to_pylist()
    )
    batch = [present[i] for i in rng.integers(0, len(present), n_present)] + absent
    rng.shuffle(batch)
    view = cache.store.cf(cache.partitions()[partition].cf)  # type: ignore[union-attr]
    arrow_batch = pa.array(batch, pa.string())  # as the tagger passes a batch's key column
    cache.lookup_array(partition, arrow_batch)  # warm the block cache
    # What the tagger calls (lookup_array: the same path as lookup, without the list form).
    cache_s, found = _report.median_time(lambda: cache.lookup_array(partition, arrow_batch), repeats)
    encoded = sorted(codec.encode_keys(batch))
    raw_s, _ = _report.median_time(partial(multi_get, view, encoded), repeats)
    del view  # rocksdict keeps the DB's LOCK while any column family view is alive
    assert sum(f is not None for f in found) >= n_present * 0.99
    return [shape, len(batch), len(batch) / cache_s, len(batch) / raw_s, raw_s / cache_s], batch


def rss_of(script: str) -> int:
    """Peak resident set size (bytes) of a fresh interpreter running `script` (it prints nothing we need)."""
    # VmHWM, not ru_maxrss: on Linux ru_maxrss carries the parent's high-water mark across fork + exec.
    code = script + ("\nprint([int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--partitions", type=int, default=30)
    parser.add_argument("--grid-partitions", type=int, default=3)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.entries, args.partitions, args.grid_partitions, args.batch, args.repeats = 60_000, 3, 1, 5_000, 1
    work = Path(tempfile.mkdtemp(prefix="dbidx-cache-bench-", dir=str(Path.cwd())))
    headline, grid, lookups, memory = [], [], [], []
    try:
        for shape in ("uuid", "seq20"):
            table = build_table(work, shape, args.entries, args.partitions)
            parts = [s.partition for s in table.partitions()]
            parquet = _report.dir_bytes(work / f"table-{shape}" / ".dbidx", "*.parquet")
            total = sum(s.live_keys for s in table.partitions())
            # 1. Headline: every entry, default options.
            cache, entries = load_cache(table, work / "c" / shape, CacheConfig(), parts)
            headline.append(
                [
                    shape,
                    entries,
                    parquet / total,
                    cache.disk_bytes() / entries,
                    cache.disk_bytes() / entries / (parquet / total),
                ]
            )
            # 2. Lookups: a batch of 80 % present / 20 % absent keys against one partition, warm.
            row, batch = measure_lookups(table, cache, shape, parts[len(parts) // 2], args.batch, args.repeats)
            lookups.append(row)
            cache_path = cache.path
            cache.close()
            # 3. Memory: a process that opens the cache and looks keys up in every partition, vs a dict.
            if shape == "uuid":
                probe_keys = work / "probe.json"
                probe_keys.write_text(json.dumps(batch))
                cache_rss = rss_of(
                    "from dbidx.cache.record_cache import RecordIndexCache\n"
                    f"c = RecordIndexCache({str(cache_path)!r}, None).open()\n"
                    f"import json; keys = json.load(open({str(probe_keys)!r}))\n"
                    "for p in c.partitions(): c.lookup(p, keys)\n"
                    # Closed before the interpreter exits: a RocksDB left open at exit can abort the process
                    # ("terminate called without an active exception") as its background threads are torn down.
                    "c.close()\n"
                )
                base_rss = rss_of("import dbidx.cache.record_cache\n")
                dict_rss = rss_of(
                    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
                    "from dbidx.table.facade import Table\n"
                    f"t = Table.open({table.uri!r})\n"
                    "m = {}\n"
                    "for s in t.partitions():\n"
                    "    snap = t.snapshot(s.partition)\n"
                    "    m.update(zip(snap.column('key').to_pylist(), snap.column('file_group').to_pylist()))\n"
                    "    del snap\n"
                )
                memory = [[entries, base_rss / 2**20, cache_rss / 2**20, dict_rss / 2**20, dict_rss / cache_rss]]
            # 4. Grid: compression x block size on the first partitions (bottommost-level files after ingest).
            grid_parts = parts[: args.grid_partitions]
            for compression in ("zstd", "lz4", "snappy", "none"):
                for block_kb in (4, 16, 64):
                    config = replace(CacheConfig(), compression=compression, block_size_kb=block_kb)
                    c, n = load_cache(table, work / "g" / shape, config, grid_parts)
                    grid.append([shape, compression, block_kb, n, c.disk_bytes() / n, parquet / total])
                    c.close()
            shutil.rmtree(work / "g", ignore_errors=True)
            shutil.rmtree(work / "c" / shape, ignore_errors=True)
            shutil.rmtree(work / f"table-{shape}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = "\n\n".join(
        [
            "## Cache (disk footprint, lookups, memory)",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. {args.entries:,} entries over "
            f"{args.partitions} partitions, one shard; file groups of ~100 k keys; cache B/entry = the whole cache "
            "directory (SSTs, registry, manifest) after bulk load and flush.",
            _report.table(
                ["keys", "entries", "index Parquet B/entry", "cache B/entry (zstd, 16 KB)", "cache / Parquet"], headline
            ),
            f"Compression x block size ({args.grid_partitions} partition(s) of each shape; index Parquet B/entry is the "
            "table-wide average):",
            _report.table(
                ["keys", "compression", "block KB", "entries", "cache B/entry", "index Parquet B/entry"], grid
            ),
            f"Batched lookup, one warm partition, batches of {args.batch:,} keys (80 % present), medians of "
            f"{args.repeats}: `RecordIndexCache.lookup` of the batch as an Arrow string array, as the tagger passes it "
            "(validate, encode, order, multi-get, decode, scatter, metrics), vs raw rocksdict "
            f"multi-gets of the pre-encoded sorted keys on the same column family, in chunks of {MULTI_GET_CHUNK} "
            "(rocksdict's per-key cost grows with the list size; the cache splits the same way):",
            _report.table(["keys", "batch", "cache keys/s", "raw multi-get keys/s", "cache / raw"], lookups),
            "Target cache / raw >= 0.8: "
            + ", ".join(f"{r[0]} {r[4]:.2f} ({'met' if r[4] >= 0.8 else 'NOT met'})" for r in lookups)
            + ".",
            f"Memory (UUID keys): peak RSS of a process that opens the cache and looks up the {args.batch:,}-key batch "
            "in every partition (64 MB block cache), vs one holding the same key -> file group map in a Python dict, "
            "and of a bare interpreter with dbidx imported (both include it):",
            _report.table(
                ["entries", "bare interpreter MB", "cache process MB", "Python dict process MB", "dict / cache"], memory
            ),
        ]
    )
    print(body)
    if args.write_results and not args.smoke:
        _report.write_section("cache", body)
        _report.write_figures(
            "cache",
            {
                "entries": args.entries,
                "lookup_batch": args.batch,
                "lookup_keys_per_s": {row[0]: row[2] for row in lookups},
            },
        )


if __name__ == "__main__":
    main()
