"""Restart benchmark: warm restart (reuse the caches on local disk, catch up K commits) vs a full re-bootstrap of
the same window, at `--keys` keys; target: warm >= 20x faster at 10 M keys.

Data: 30 daily partitions of random UUID keys, one shard cache (one executor's view). After the caches are
bootstrapped, K commits of `--commit-keys` entries each arrive (new keys on the latest days, 10% deletes of existing
keys); then both ways of getting a serving cache are timed: `bootstrap()` over the intact caches (it only catches up)
and `bootstrap()` into an emptied base path.
Second part, the catch-up crossover: one partition of `--held` keys in one shard cache, then one commit whose
change is a fraction of it (half deletes of held keys, the rest new keys); timed both ways a cache can take it:
applying the entries (`sync`, one write per entry) and reloading the partition from the snapshot
(the bulk SST path). The ratio where reloading wins is what `sync` uses to choose (cache/catchup.py).
Run: `python benchmarks/restart_bench.py [--keys 10000000] [--held 300000] [--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from bootstrap_bench import FIRST_DAY, build_table, partition_of, uuid_keys

from dbidx.bootstrap.time_bounded import bootstrap
from dbidx.cache import catchup
from dbidx.cache.catchup import sync
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.table.facade import Table

DAYS = 30


def add_commits(table, count: int, commit_keys: int, rng: np.random.Generator) -> None:
    """`count` upsert-like commits: new keys on the last three days, 10% deletes of existing keys."""
    for i in range(count):
        day = DAYS - 1 - i % 3
        with table.new_commit() as writer:
            writer.insert(partition_of(day), uuid_keys(commit_keys - commit_keys // 10, rng), "00000000-restart")
            victims = table.snapshot(partition_of(i % DAYS)).column("key").slice(0, commit_keys // 10)
            writer.delete(partition_of(i % DAYS), victims)


def warm_vs_full(
    work: Path, keys: int, commits: list[int], commit_keys: int, repeats: int, rng: np.random.Generator
) -> list[list[object]]:
    """Per K of `commits` (cumulative): [K, entries to catch up, entries in the window, warm restart s (median of
    `repeats`), full re-bootstrap s (median), "<full / warm>x"], for a one-shard table of `keys` keys under work."""
    now = str(FIRST_DAY + DAYS - 1)
    rows: list[list[object]] = []
    done = 0
    table = build_table(work, DAYS, keys // DAYS, 1)
    caches = work / "caches"
    bootstrap(table, days=DAYS, now=now, base_path=caches)
    for k in commits:
        add_commits(table, k - done, commit_keys, rng)
        done = k
        # 1. Warm: the caches are intact; bootstrap reuses every partition and catches up the K commits.
        #    Each repeat starts from caches that are K commits behind (a copy taken before the first run).
        shutil.copytree(caches, work / "behind")
        warm_runs = []
        for _ in range(repeats):
            shutil.rmtree(caches)
            shutil.copytree(work / "behind", caches)
            warm_runs.append(bootstrap(table, days=DAYS, now=now, base_path=caches))
        warm = sorted(warm_runs, key=lambda r: r.seconds)[len(warm_runs) // 2]
        # 2. Full: the same window into an empty base path.
        full_runs = []
        for _ in range(repeats):
            shutil.rmtree(work / "full", ignore_errors=True)
            full_runs.append(bootstrap(table, days=DAYS, now=now, base_path=work / "full"))
        full = sorted(full_runs, key=lambda r: r.seconds)[len(full_runs) // 2]
        shutil.rmtree(work / "behind")
        rows.append(
            [k, k * commit_keys, full.entries, warm.seconds, full.seconds, f"{full.seconds / warm.seconds:.0f}x"]
        )
    return rows


FRACTIONS = (0.01, 0.1, 0.3, 1.0, 2.0, 4.0)


def crossover(work: Path, held: int, repeats: int, rng: np.random.Generator) -> list[list[object]]:
    """Per change fraction: seconds to apply the change vs to reload the partition (medians of `repeats`)."""
    table = Table.create(str(work / "crossover"), num_shards=1, checkpoint_interval=0)
    partition = partition_of(0)
    keys = uuid_keys(held, rng)
    with table.new_commit() as writer:
        writer.insert(partition, keys, "fg-0")
    chosen, catchup.RELOAD_FRACTION = catchup.RELOAD_FRACTION, float("inf")  # time applying even where it loses
    try:
        return _crossover_rows(work, table, partition, held, repeats, rng)
    finally:
        catchup.RELOAD_FRACTION = chosen


def _crossover_rows(
    work: Path, table: Table, partition: str, held: int, repeats: int, rng: np.random.Generator
) -> list[list[object]]:
    import time

    rows: list[list[object]] = []
    for fraction in FRACTIONS:
        n = max(2, int(held * fraction))
        base = work / "crossover-cache"
        shutil.rmtree(base, ignore_errors=True)
        config = CacheConfig(max_catchup_entries=10**12)
        with RecordIndexCache.for_table(table, 0, config, base_path=base).open() as cache:
            load_from_snapshot(cache, table, partition, table.timeline.latest_seq)
            cache.set_watermark(table.timeline.latest_seq)
        shutil.copytree(base, work / "behind")
        current = table.snapshot(partition).column("key")
        # What a partitioned table commits: tombstones of held keys (at their location) and inserts of new ones.
        gone = min(n // 2, len(current))
        with table.new_commit() as writer:
            writer.delete(partition, current.slice(0, gone))  # resolved to their file groups
            writer.insert(partition, uuid_keys(n - gone, rng), "fg-1")
        apply_s, reload_s = [], []
        for _ in range(repeats):
            for way, out in (("apply", apply_s), ("reload", reload_s)):
                shutil.rmtree(base)
                shutil.copytree(work / "behind", base)
                with RecordIndexCache.for_table(table, 0, config, base_path=base).open() as cache:
                    start = time.perf_counter()
                    if way == "apply":
                        result = sync(cache, table)  # RELOAD_FRACTION is lifted above: it always applies
                        assert result.applied_partitions == [partition], result
                    else:
                        load_from_snapshot(cache, table, partition, table.timeline.latest_seq)
                    out.append(time.perf_counter() - start)
        shutil.rmtree(work / "behind")
        apply_m, reload_m = sorted(apply_s)[len(apply_s) // 2], sorted(reload_s)[len(reload_s) // 2]
        rows.append(
            [
                f"{fraction:.0%}",
                f"{n:,}",
                f"{len(current):,}",
                f"{apply_m:.3f}",
                f"{reload_m:.3f}",
                "reload" if reload_m < apply_m else "apply",
                f"{n / apply_m:,.0f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--commits", default="1,10,50", help="K values (cumulative), comma separated")
    parser.add_argument("--commit-keys", type=int, default=10_000)
    parser.add_argument("--held", type=int, default=300_000, help="keys of the partition in the crossover part")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.commits, args.commit_keys, args.repeats, args.held = 60_000, "1,2", 1_000, 1, 5_000
    work = Path(tempfile.mkdtemp(prefix="dbidx-restart-bench-", dir=str(Path.cwd())))
    rng = np.random.default_rng(21)
    try:
        rows = warm_vs_full(
            work, args.keys, [int(c) for c in args.commits.split(",")], args.commit_keys, args.repeats, rng
        )
        cross = crossover(work, args.held, args.repeats, rng)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [(r[0], r[1], float(r[5][:-1])) for r in rows]
    met = [(k, entries) for k, entries, ratio in ratios if ratio >= 20]
    missed = [k for k, _, ratio in ratios if ratio < 20]
    if not missed:
        target = f"met at every K (up to {met[-1][1] / args.keys:.0%} of the index to catch up)."
    elif met:
        target = (
            f"met up to K = {met[-1][0]} ({met[-1][1] / args.keys:.0%} of the index to catch up), NOT at K = "
            f"{', '.join(map(str, missed))}."
        )
    else:
        target = "not met at any K."
    verdict = (
        f"Warm restart is {ratios[0][2]:.0f}x faster than a full re-bootstrap after {ratios[0][0]} commit(s) "
        f"and {ratios[-1][2]:.0f}x after {ratios[-1][0]}. The >= 20x target is {target}"
    )
    body = "\n\n".join(
        [
            "## Warm restart vs full re-bootstrap",
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. {args.keys:,} keys in {DAYS} daily "
            f"partitions, one shard; K commits of {args.commit_keys:,} entries (90% new keys, 10% deletes) after the "
            f"caches were built; medians of {args.repeats}.",
            _report.table(
                [
                    "K commits",
                    "entries to catch up",
                    "entries in the window",
                    "warm restart s",
                    "full re-bootstrap s",
                    "full / warm",
                ],
                rows,
            ),
            verdict,
            f"### Catch-up crossover: applying a change vs reloading the partition ({args.held:,} keys, one shard)",
            "One commit changes a fraction of the partition (half deletes of held keys, as far as there are, the rest new "
            "keys: a partitioned table's index entries); the cache takes it by applying the entries (`sync`) or by "
            "reloading the partition's snapshot through the SST bulk path. `sync` reloads when the change exceeds "
            "`catchup.RELOAD_FRACTION` of what the cache holds for the partition (cache/catchup.py).",
            _report.table(
                ["change / held", "entries to apply", "keys held", "apply s", "reload s", "faster", "apply entries/s"],
                cross,
            ),
        ]
    )
    if args.write_results and not args.smoke:
        body = _report.publish("restart", body, {"keys": args.keys, "rows": rows, "crossover": cross})
    print(body)


if __name__ == "__main__":
    main()
