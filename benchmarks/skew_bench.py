"""Bucket skew benchmark: simple buckets (`hash(key) % N`) vs dynamic buckets over 60 days of
growth in one partition: max and p99 bucket size and the bucket count, day by day.

The partition keeps receiving new keys (a non-date partition, e.g. a region or a tenant), `--first-day` new keys on
day 1 growing `--growth` per day. Both modes run the real assigners of `dbidx.buckets` on UUID keys; dynamic buckets
are assigned per key shard (`--shards` shards, each opening only the buckets it owns).
Run: `python benchmarks/skew_bench.py [--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from bootstrap_bench import uuid_keys

from dbidx.buckets.assigner import DynamicBucketAssigner, SimpleBucketAssigner
from dbidx.storage.keyhash import shard_of

PARTITION = "region=eu"


def sizes_summary(counts: Counter) -> tuple[int, int, int]:
    """(max, p99, number of buckets) of bucket sizes."""
    values = np.fromiter(counts.values(), dtype=np.int64)
    return int(values.max()), int(np.percentile(values, 99)), len(values)


def simulate(days: int, first_day: int, growth: float, shards: int, num_buckets: int, capacity: int) -> list[list]:
    rng = np.random.default_rng(17)
    simple = SimpleBucketAssigner("skew", num_buckets)
    dynamic = [DynamicBucketAssigner("skew", shards, s, capacity) for s in range(shards)]
    simple_sizes: Counter = Counter()
    dynamic_sizes: Counter = Counter()
    rows, total = [], 0
    for day in range(1, days + 1):
        n = int(first_day * (1 + growth) ** (day - 1))
        keys = uuid_keys(n, rng)
        total += n
        simple_sizes.update(simple.assign(PARTITION, keys, {}).to_pylist())
        owners = shard_of(keys, shards)
        for shard, assigner in enumerate(dynamic):
            mine = keys.filter(pa.array(owners == shard))
            dynamic_sizes.update(assigner.assign(PARTITION, mine, {}).to_pylist())
        rows.append([day, n, total, *sizes_summary(simple_sizes), *sizes_summary(dynamic_sizes)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=60)
    parser.add_argument("--first-day", type=int, default=20_000, help="new keys on day 1")
    parser.add_argument("--growth", type=float, default=0.03, help="daily growth of new keys")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--num-buckets", type=int, default=16, help="N of the simple buckets")
    parser.add_argument("--capacity", type=int, default=50_000, help="dynamic bucket capacity (keys)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.days, args.first_day, args.capacity = 6, 500, 700
    rows = simulate(args.days, args.first_day, args.growth, args.shards, args.num_buckets, args.capacity)
    shown = [r for r in rows if r[0] % 10 == 0 or r[0] in (1, args.days)]
    last = rows[-1]
    first = rows[0]
    verdict = (
        f"After {args.days} days ({last[2]:,} keys): the largest simple bucket grew from {first[3]:,} keys "
        f"(day 1) to {last[3]:,} ({last[3] / args.capacity:.1f}x the dynamic capacity), a fixed N growing "
        f"with the partition; "
        f"dynamic buckets stay at most {last[6]:,} keys ({'within' if last[6] <= args.capacity else 'OVER'} "
        f"the capacity of {args.capacity:,}) with {last[8]:,} buckets."
    )
    body = "\n\n".join(
        [
            "## Bucket skew: simple vs dynamic",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. One partition, {args.first_day:,} new UUID "
            f"keys on day 1 growing {args.growth:.0%} a day; simple: N = {args.num_buckets}; dynamic: capacity "
            f"{args.capacity:,} keys, {args.shards} shards.",
            _report.table(
                [
                    "day",
                    "new keys",
                    "keys",
                    "simple max",
                    "simple p99",
                    "simple buckets",
                    "dynamic max",
                    "dynamic p99",
                    "dynamic buckets",
                ],
                shown,
            ),
            verdict,
        ]
    )
    if args.write_results and not args.smoke:
        body = _report.publish("skew", body, {"days": args.days, "capacity": args.capacity, "rows": rows})
    print(body)


if __name__ == "__main__":
    main()
