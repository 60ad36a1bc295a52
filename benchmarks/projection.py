"""The billion-key projection: benchmarks/PROJECTION.md computed from the figures the benchmarks measured.

Inputs (written by `--write-results` runs): results/footprint.json (bytes per entry), results/bootstrap.json
(per-core bootstrap rate), results/restart.json (catch-up), results/cache.json (lookup rate), results/spark.json
(per-batch tagging), and, if present, results/scale.json (scale_bench: the largest size measured on this machine,
a section of its own). Every number in PROJECTION.md is either one of those figures or arithmetic on them and the
stated assumptions; nothing is typed by hand. It also rewrites the figures of the README's Performance section.
Run: `python benchmarks/projection.py [--print-only]` (after `make bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

HERE = Path(__file__).resolve().parent
ASSUMPTIONS = {
    "keys": 1_000_000_000,
    "partitions": 365,
    "new_keys_per_day": 10_000_000,
    "executors": 100,
    "window_days": 7,
    "cores_per_executor": 4,
    "restart_gap_hours": 1.0,
    "object_store_mb_per_s": 100,
}


def load(name: str) -> dict:
    path = HERE / "results" / f"{name}.json"
    if not path.exists():
        raise SystemExit(
            f"{path} is missing: run `python benchmarks/{name}_bench.py --write-results` first (or `make bench`)"
        )
    return json.loads(path.read_text())


def load_optional(name: str) -> dict | None:
    """The figures of an optional benchmark, None when it has not been run with --write-results."""
    path = HERE / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def scale_section(scale: dict) -> str:
    """Measured scale: tagging and bootstrap at the largest index scale_bench ran on this machine (no arithmetic
    beyond ratios)."""
    sizes = sorted(scale["sizes"], key=lambda r: r["keys"])
    small, large = sizes[0], sizes[-1]
    full, window = large["full_bootstrap"], large["window_bootstrap"]
    rows = [
        [
            f"tagging a {scale['batch_rows']:,}-row batch, warm",
            f"{large['warm_s']:.2f} s",
            f"median of {scale['repeats']} at {large['keys']:,} keys"
            + (
                f"; {small['warm_s']:.2f} s at {small['keys']:,} keys ({large['warm_s'] / small['warm_s']:.2f}x)"
                if small is not large
                else ""
            ),
        ],
        [
            "cold first batch (every touched partition loads on demand)",
            f"{large['cold_s']:.1f} s",
            f"both shards' caches empty, at {large['keys']:,} keys",
        ],
        [
            "bootstrap rate, one shard, all 30 days",
            f"{full['entries_per_s']:,.0f} entries/s",
            f"{full['entries']:,} entries in {full['seconds']:.1f} s ({full['parallelism']})",
        ],
        [
            f"bootstrap, one shard, {scale['window_days']}-day window",
            f"{window['seconds']:.1f} s",
            f"{window['entries']:,} entries at {window['entries_per_s']:,.0f} entries/s ({window['parallelism']})",
        ],
        [
            "cache / index bytes per entry",
            f"{full['bytes_per_entry']:.1f} / {large['index_bytes_per_entry']:.1f} B",
            f"the one-shard 30-day cache; the index's Parquet ({large['index_bytes'] / 1e9:.1f} GB)",
        ],
    ]
    return "\n\n".join(
        [
            f"## Measured scale: {large['keys']:,} keys on this machine",
            f"Measured, not projected: scale_bench ({scale['machine'].split(';')[0]}, Spark local[2], "
            f"{scale['shards']} shards, {scale['partitions']} daily partitions). {scale['verdict']}",
            _report.table(["quantity", "value", "from"], rows),
            f"Input: scale: `{scale['command']}`",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-only", action="store_true", help="print, do not write PROJECTION.md and README")
    args = parser.parse_args()
    a = ASSUMPTIONS
    footprint, boot, restart, cache = load("footprint"), load("bootstrap"), load("restart"), load("cache")
    spark = load("spark")
    # 1. Measured inputs.
    largest = max(r[1] for r in footprint["headline"])
    uuid_rows = [r for r in footprint["headline"] if r[0] == "uuid" and r[1] >= largest * 0.99]
    b_entry = max(r[4] for r in uuid_rows)  # the worst partition count measured, UUID keys
    index_entry = max(r[3] for r in uuid_rows)
    rate = boot["window_entries_per_s"]
    big_rate = max([rate] + [r[4] for r in boot.get("rows", [])])
    catch = restart["rows"]
    k, caught, _, warm_s, _, _ = catch[-1]
    catchup_rate = caught / warm_s
    lookups = cache["lookup_keys_per_s"]["uuid"]
    tag = max(spark["sizes"], key=lambda r: r["keys"])
    # 2. Arithmetic.
    window_entries = a["window_days"] * a["new_keys_per_day"]
    per_exec = window_entries / a["executors"]
    day_exec = a["new_keys_per_day"] / a["executors"]
    since_restart = a["new_keys_per_day"] * a["restart_gap_hours"] / 24 / a["executors"]
    rows = [
        [
            "entries in the 7-day window (whole table)",
            f"{window_entries:,.0f}",
            f"{a['window_days']} days x {a['new_keys_per_day']:,} new keys/day",
        ],
        ["entries per executor (its shards)", f"{per_exec:,.0f}", f"window / {a['executors']} executors"],
        [
            "cache disk per executor, 7-day window",
            f"{per_exec * b_entry / 1e9:,.2f} GB",
            f"x {b_entry:.1f} B/entry (UUID keys, {largest:,}-entry footprint run, worst partition count)",
        ],
        [
            "cache disk per executor, all 1 B keys loaded",
            f"{a['keys'] / a['executors'] * b_entry / 1e9:,.1f} GB",
            "the whole index on local disk (global bootstrap)",
        ],
        [
            "whole-table cache on all executors, 7-day window",
            f"{window_entries * b_entry / 1e9:,.1f} GB",
            "vs RFC-107's estimate of ~4.2 GB for the same 70 M entries",
        ],
        [
            "bootstrap per executor, 7-day window",
            f"{per_exec / rate:,.1f} s",
            f"at {rate:,.0f} entries/s (bootstrap_bench, best mode on this {boot['machine'].split(',')[0]} machine)",
        ],
        [
            "index Parquet read per executor for that bootstrap",
            f"{per_exec * index_entry / 1e6:,.0f} MB",
            f"x {index_entry:.1f} B/entry; read from local disk here, from an object store at "
            f"{a['object_store_mb_per_s']} MB/s add {per_exec * index_entry / 1e6 / a['object_store_mb_per_s']:,.1f} s",
        ],
        [
            "global bootstrap per executor (all 1 B keys)",
            f"{a['keys'] / a['executors'] / big_rate:,.0f} s",
            f"{a['keys'] / a['executors']:,.0f} entries at {big_rate:,.0f} entries/s (the best rate of a large load in "
            "bootstrap_bench; global index mode ignores the window)",
        ],
        [
            "on-demand stall, one cold day-partition",
            f"{day_exec / 1e6 * boot['stall_s_per_million']:,.2f} s",
            f"{day_exec:,.0f} entries of one day per executor x {boot['stall_s_per_million']:.2f} s per 1 M "
            "(bootstrap_bench)",
        ],
        [
            "warm restart per executor",
            f"{since_restart / catchup_rate:,.2f} s + open",
            f"{since_restart:,.0f} entries committed in {a['restart_gap_hours']:g} h, at {catchup_rate:,.0f} "
            f"entries/s catch-up (restart_bench, K={k})",
        ],
        ["full re-bootstrap instead (same window)", f"{per_exec / rate:,.1f} s", "what the warm restart avoids"],
        [
            "cache lookups per executor",
            f"{lookups * a['cores_per_executor']:,.0f} keys/s",
            f"{lookups:,.0f} keys/s per core (cache_bench, batched) x {a['cores_per_executor']} cores",
        ],
        [
            "tagging a 100 k-row batch (Spark)",
            f"{tag['dbidx_s']:.2f} s vs {tag['join_s']:.2f} s join",
            f"measured at {tag['keys']:,} keys on 2 cores (spark_bench); the join grows with the index, dbidx does not",
        ],
    ]
    body = "\n\n".join(
        [
            "# The billion-key projection",
            "Computed by `python benchmarks/projection.py` from the figures in `benchmarks/results/*.json`, which the "
            "benchmark scripts wrote on this machine (`make bench`); see benchmarks/RESULTS.md for the runs.",
            "Assumptions: "
            + "; ".join(
                f"{k.replace('_', ' ')} = {v:,}" if isinstance(v, int) else f"{k.replace('_', ' ')} = {v}"
                for k, v in a.items()
            )
            + ". Keys are UUID strings (the least compressible shape measured). The window holds the last 7 days at the "
            "current rate. Each executor holds the shards of its tasks (shards = executors); executors work in "
            "parallel; per-core rates measured here scale to the executor's cores only where stated.",
            _report.table(["quantity", "value", "from"], rows),
            "Inputs: "
            + "; ".join(
                f"{name}: `{data['command']}`"
                for name, data in (
                    ("footprint", footprint),
                    ("bootstrap", boot),
                    ("restart", restart),
                    ("cache", cache),
                    ("spark", spark),
                )
                if "command" in data
            ),
        ]
    )
    scale = load_optional("scale")
    if scale is not None:
        body = "\n\n".join([body, scale_section(scale)])
    print(body)
    block = readme_block(footprint, spark, boot, restart, load("skew"), largest)
    print(block)
    if not args.print_only:
        (HERE / "PROJECTION.md").write_text(body + "\n")
        _report.write_section("performance", block, target=HERE.parent / "README.md")


def readme_block(footprint: dict, spark: dict, boot: dict, restart: dict, skew: dict, largest: int) -> str:
    """The README's Performance figures, from the same results (so the README never disagrees with RESULTS.md)."""
    at = {(r[0], r[2]): r for r in footprint["headline"] if r[1] >= largest * 0.99}
    dicts = {r[0]: r[2] for r in footprint["dict"] if r[1] == max(d[1] for d in footprint["dict"])}
    tag = max(spark["sizes"], key=lambda r: r["keys"])
    first, last = restart["rows"][0], restart["rows"][-1]
    grown = skew["rows"][-1]
    lines = [
        f"- Disk, {largest:,} entries over 30 partitions: the cache takes {at[('uuid', 30)][4]:.1f} B/entry for "
        f"UUID keys ({at[('uuid', 30)][3]:.1f} in the index's Parquet, {dicts['uuid']:.0f} in a Python dict), "
        f"{at[('numeric20', 30)][4]:.1f} for 20-digit ids, {at[('composite', 30)][4]:.1f} for composite keys; "
        "RFC-107 estimated 50-70 B/entry.",
        f"- Tagging a {spark['batch_rows']:,}-row batch against {tag['keys']:,} keys: {tag['dbidx_s']:.2f} s with "
        f"dbidx vs {tag['join_s']:.2f} s as a Spark join against the index ({tag['join_s'] / tag['dbidx_s']:.1f}x) "
        f"vs {tag['dict_s']:.2f} s with a driver-side dict that needs {tag['dict_mb']:,.0f} MB on the driver.",
        f"- Bootstrap: {boot['window_entries_per_s']:,.0f} entries/s on one executor; warm restart after "
        f"{first[0]} / {last[0]} commits: {first[3]:.2f} / {last[3]:.2f} s vs {first[4]:.1f} / {last[4]:.1f} s for "
        f"a full re-bootstrap of {first[2]:,} entries.",
        f"- Buckets over {skew['days']} days of growth: the largest simple (hash) bucket reaches "
        f"{grown[3]:,} keys; dynamic buckets stay at most {grown[6]:,} (capacity "
        f"{skew['capacity']:,}) with {grown[8]} buckets.",
        "- The billion-key projection: [benchmarks/PROJECTION.md](benchmarks/PROJECTION.md).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
