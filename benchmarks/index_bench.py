"""Index benchmark: write, snapshot and lookup speed of the persisted index, its bytes per entry, and the
seek-vs-scan crossover that sets rli_files.DEFAULT_SEEK_THRESHOLD.

Why these figures: the index is read by every bootstrap and catch-up (snapshot rate), written by every commit
(write rate), and queried directly when no cache is warm (lookup latency); its bytes per entry is the baseline
the cache's disk footprint is held to. Run: `python benchmarks/index_bench.py [--entries N] [--write-results]`.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

from dbidx.index import rli_files
from dbidx.table.facade import Table

PARTITION = "dt=2025-01-15"


def make_keys(shape: str, n: int, seed: int = 1) -> list[str]:
    """Random UUID strings or 20-digit zero-padded sequential ids."""
    rng = random.Random(seed)
    if shape == "uuid":
        return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n)]
    start = 10**15
    return [f"{start + i:020d}" for i in range(n)]


def file_groups(n: int, per_group: int = 100_000) -> list[str]:
    """Bucket-style file group ids, ~per_group keys each."""
    groups = [f"{b:08d}-{uuid.UUID(int=b + 1).hex[-12:]}" for b in range(max(1, n // per_group))]
    return [groups[i % len(groups)] for i in range(n)]


def write_table(root: Path, keys: list[str], fgs: list[str], shards: int) -> Table:
    """A fresh table with all entries in one commit."""
    shutil.rmtree(root, ignore_errors=True)
    table = Table.create(str(root), num_shards=shards)
    with table.new_commit() as w:
        w.insert(PARTITION, pa.array(keys, pa.string()), pa.array(fgs, pa.string()))
    return table


def bench_shape(shape: str, n: int, repeats: int, work: Path) -> tuple[list[list], list[list], float]:
    """Write/read/bytes rows, lookup rows and the measured crossover fraction for one key shape."""
    keys, fgs = make_keys(shape, n), file_groups(n)
    rows, lookups = [], []
    for shards in (1, 8):
        secs, table = _report.median_time(lambda s=shards: write_table(work / f"{shape}-{s}", keys, fgs, s), repeats)
        rli_bytes = _report.dir_bytes(work / f"{shape}-{shards}" / ".dbidx" / "rli", "*.parquet")
        snap_secs, snap = _report.median_time(lambda t=table: t.snapshot(PARTITION), repeats)
        assert snap.num_rows == n
        rows.append([shape, shards, n, round(n / secs), round(n / snap_secs), round(rli_bytes / n, 2)])
    # Lookups against the 1-shard table: one file, many row groups.
    table = Table.open(str(work / f"{shape}-1"))
    record = table.refresh().files(PARTITION, 0)[0]
    handle = rli_files.open_rli_file(table.io, record)
    groups = handle.metadata.num_row_groups
    rng = random.Random(5)
    crossover = 1.0
    for size in (10, 100, 1_000, 10_000, 100_000, 300_000):
        if size > n:
            continue
        probe = rng.sample(keys, size) + [f"absent-{i}" for i in range(size // 10)]
        touched = len(rli_files.touched_row_groups(handle, sorted(probe))) / groups
        seek_s, seek = _report.median_time(lambda p=probe: table.lookup(p, PARTITION, mode="seek"), repeats)
        scan_s, scan = _report.median_time(lambda p=probe: table.lookup(p, PARTITION, mode="scan"), repeats)
        auto_s, _ = _report.median_time(lambda p=probe: table.lookup(p, PARTITION, mode="auto"), repeats)
        assert seek.sort_by("key").equals(scan.sort_by("key")) and seek.num_rows == size
        if scan_s <= seek_s and touched < crossover:
            crossover = touched
        lookups.append([shape, size, round(touched, 3), seek_s * 1000, scan_s * 1000, auto_s * 1000])
    return rows, lookups, crossover


def verification_cost(shape: str, n: int, repeats: int, work: Path) -> list:
    """What checking a file's integrity costs, per MB of RLI file: whole-file XXH64 (what dbidx does) vs Parquet
    page checksums (CRC32 per page, written and verified by pyarrow), against decoding the same file."""
    import pyarrow.parquet as pq
    import xxhash

    table = Table.open(str(work / f"{shape}-1"))
    record = table.refresh().files(PARTITION, 0)[0]
    data = table.io.read_bytes(record.path)
    entries = rli_files.read_rli_file(table.io, record)
    mb = len(data) / 1e6
    hash_s, _ = _report.median_time(lambda: xxhash.xxh64(data).hexdigest(), repeats)
    decode_s, _ = _report.median_time(lambda: pq.read_table(pa.BufferReader(data)), repeats)
    verified_s, _ = _report.median_time(lambda: rli_files.read_rli_file(table.io, record), repeats)

    def write(checksums: bool) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        pq.write_table(entries, sink, compression="zstd", write_page_checksum=checksums)
        return sink.getvalue()

    plain_w, _ = _report.median_time(lambda: write(False), repeats)
    crc_w, crc_file = _report.median_time(lambda: write(True), repeats)
    crc_r, _ = _report.median_time(
        lambda: pq.ParquetFile(pa.BufferReader(crc_file), page_checksum_verification=True).read(), repeats
    )
    return [
        shape,
        round(mb, 1),
        hash_s * 1000 / mb,
        decode_s * 1000 / mb,
        verified_s * 1000 / mb,
        (crc_w - plain_w) * 1000 / mb,
        (crc_r - decode_s) * 1000 / mb,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    parser.add_argument("--smoke", action="store_true", help="20 k entries, 1 repeat: checks the script runs")
    parser.add_argument("--write-results", action="store_true", help="rewrite the index section of RESULTS.md")
    args = parser.parse_args()
    n, repeats = (20_000, 1) if args.smoke else (args.entries, args.repeats)
    work = Path(args.dir or tempfile.mkdtemp(prefix="dbidx-index-bench-"))
    try:
        rows, lookups, crossovers, costs = [], [], {}, []
        for shape in ("uuid", "seq20"):
            r, lk, cross = bench_shape(shape, n, repeats, work)
            rows += r
            lookups += lk
            crossovers[shape] = cross
            costs.append(verification_cost(shape, n, repeats, work))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    out = [
        f"Machine: {_report.machine()}. Command: `{_report.command()}`. Medians of {repeats} run(s). One partition of "
        f"{n:,} entries written in one commit; file groups of 100 k keys; row groups of 8192 rows; zstd.",
        "",
        _report.table(["keys", "shards", "entries", "write entries/s", "snapshot entries/s", "Parquet B/entry"], rows),
        "",
        _report.table(
            ["keys", "lookup keys (+10% absent)", "row groups touched", "seek ms", "scan ms", "auto ms"], lookups
        ),
        "",
        "Seek/scan crossover (smallest touched fraction at which a scan was as fast as seeking): "
        + ", ".join(f"{k} {v:.2f}" for k, v in crossovers.items())
        + f". DEFAULT_SEEK_THRESHOLD = {rli_files.DEFAULT_SEEK_THRESHOLD}. Every read verifies the whole file "
        "(size + XXH64), so seek saves decoding, not I/O.",
        "",
        "Integrity check cost, ms per MB of RLI file (the 1-shard file above): XXH64 over the bytes (what dbidx "
        "does on every read) vs decoding the file, a verified read (read + XXH64 + decode), and the extra cost of "
        "Parquet page checksums (CRC32 per page) on write and on a verifying read.",
        "",
        _report.table(
            [
                "keys",
                "file MB",
                "XXH64 ms/MB",
                "decode ms/MB",
                "verified read ms/MB",
                "page CRC write +ms/MB",
                "page CRC verify +ms/MB",
            ],
            costs,
        ),
    ]
    text = "\n".join(out)
    print(text)
    if args.write_results and not args.smoke:
        _report.write_section("index", "## Index (persisted record index)\n\n" + text)


if __name__ == "__main__":
    main()
