"""Bootstrap: fill shard caches with the last X days of partitions (or, in global mode, the shard's whole slice).

The RFC-107 bootstrap re-reads the window on every start; this one reuses an intact local cache (warm restart,
docs/BOOTSTRAP.md): partitions already ready are only caught up, and only missing ones are loaded. Every shard loads
only its own file groups, all (shard, partition) slices go through one parallel loader (bootstrap/loader.py), and
the window that was loaded (first day, oldest partition, the instant it reflects) is recorded in each cache's
registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dbidx.bootstrap.loader import LoadJob, PartitionLoader
from dbidx.bootstrap.selection import Selection, select_partitions
from dbidx.cache import catchup
from dbidx.cache.inspect import is_cache_dir
from dbidx.cache.record_cache import GLOBAL_PARTITION, RecordIndexCache
from dbidx.cache.registry import table_cache_dir_name
from dbidx.config import CacheConfig
from dbidx.errors import CacheMismatchError, InvalidInputError
from dbidx.table.facade import Table
from dbidx.progress import Progress

INFO_NAME = "bootstrap"


@dataclass
class ShardBootstrap:
    """What the bootstrap did for one shard's cache."""

    shard: int
    cache_path: str
    loaded: list[str] = field(default_factory=list)
    already_ready: list[str] = field(default_factory=list)
    entries: int = 0
    caught_up_entries: int = 0
    disk_bytes: int = 0


@dataclass
class BootstrapResult:
    """What a bootstrap loaded, how big it is and how long it took."""

    table: str
    days: int
    selection: dict[str, Any]
    seq: int
    parallelism: str
    shards: list[ShardBootstrap] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def entries(self) -> int:
        """Entries loaded (not counting partitions that were already ready)."""
        return sum(s.entries for s in self.shards)

    @property
    def partitions_loaded(self) -> int:
        """(shard, partition) slices loaded."""
        return sum(len(s.loaded) for s in self.shards)

    @property
    def disk_bytes(self) -> int:
        """On-disk bytes of the bootstrapped caches."""
        return sum(s.disk_bytes for s in self.shards)

    @property
    def entries_per_second(self) -> float:
        """End-to-end load rate (index Parquet -> ready column families)."""
        return self.entries / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what `dbidx cache bootstrap --json` prints)."""
        return {
            "table": self.table,
            "days": self.days,
            "seq": self.seq,
            "parallelism": self.parallelism,
            "partitions_loaded": self.partitions_loaded,
            "entries": self.entries,
            "disk_bytes": self.disk_bytes,
            "seconds": round(self.seconds, 3),
            "entries_per_second": round(self.entries_per_second),
            "selection": self.selection,
            "shards": [vars(s) for s in self.shards],
        }


def resolve_shards(table: Table, shards: Sequence[int] | None, num_shards: int | None = None) -> list[int]:
    """The shards to bootstrap (None = all), checked against the table's shard count."""
    if num_shards is not None and num_shards != table.num_shards:
        raise InvalidInputError(
            f"--num-shards {num_shards} does not match table {table.uri}, which has "
            f"{table.num_shards} shards (fixed at creation)"
        )
    if shards is None:
        return list(range(table.num_shards))
    for shard in shards:
        if not isinstance(shard, int) or not 0 <= shard < table.num_shards:
            raise InvalidInputError(f"shard {shard!r} is out of range 0..{table.num_shards - 1} for {table.uri}")
    return sorted(set(shards))


def plan_jobs(
    cache: RecordIndexCache, table: Table, selection: Selection, seq: int, table_keys: int
) -> tuple[list[LoadJob], list[str]]:
    """(jobs for partitions this cache lacks, partitions already ready) for one shard cache; table_keys = live
    keys of the whole table (what a global-mode shard's slice is estimated from)."""
    if cache.global_mode:
        wanted = [(GLOBAL_PARTITION, table_keys)]
    else:
        wanted = [(s.partition, s.live_keys) for s in selection.selected]
    jobs, ready = [], []
    for partition, live_keys in wanted:
        if cache.is_ready(partition):
            ready.append(partition)
        else:
            jobs.append(LoadJob(cache, partition, seq, live_keys // table.num_shards))
    return jobs, ready


def bootstrap_caches(
    caches: Sequence[RecordIndexCache],
    table: Table,
    days: int | None = None,
    now: Any = None,
    pattern: str | None = None,
    parallelism: str = "auto",
    workers: int | None = None,
    progress: Progress | None = None,
    flush_interval_s: float = 1.0,
) -> BootstrapResult:
    """Bootstrap open shard caches of one table: catch up what they hold, load the window's missing partitions."""
    started = time.perf_counter()
    if not caches:
        raise InvalidInputError("bootstrap needs at least one shard cache")
    days = caches[0].config.bootstrap_days if days is None else days
    for cache in caches:
        catchup.check_table(cache, table)
    # 1. The instant everything is loaded at, and the partitions of the window.
    seq = table.refresh().applied_seq  # what the index view holds (the timeline object may be ahead of it)
    stats = table.partitions()
    selection = select_partitions(stats, days, now, pattern)
    table_keys = sum(s.live_keys for s in stats)
    # 2. Per shard: what is missing (ready partitions are kept: warm restart).
    jobs, results = [], []
    for cache in caches:
        shard_jobs, ready = plan_jobs(cache, table, selection, seq, table_keys)
        jobs += shard_jobs
        results.append(ShardBootstrap(cache.shard, str(cache.path), already_ready=ready))
    # 3. Load all missing (shard, partition) slices in one parallel pass.
    loader = PartitionLoader(table, parallelism, workers, progress, flush_interval_s)
    by_shard = {r.shard: r for r in results}
    for outcome in loader.load(jobs):
        by_shard[outcome.shard].loaded.append(outcome.partition)
        by_shard[outcome.shard].entries += outcome.entries
    # 4. Catch every partition up to the latest completion (commits during the load, warm partitions behind),
    #    then record the window in the registry.
    for cache, result in zip(caches, results):
        result.caught_up_entries = catchup.sync(cache, table).applied_entries
        cache.set_info(
            INFO_NAME,
            {
                "days": days,
                "now": selection.now.isoformat(),
                "first_day": selection.first_day.isoformat(),
                "oldest_partition": selection.oldest,
                "loaded_seq": seq,
                "at_ms": int(time.time() * 1000),
                "partitions": len(result.loaded) + len(result.already_ready),
            },
        )
        cache.flush()
        result.disk_bytes = cache.disk_bytes()
    return BootstrapResult(
        table.uri, days, selection.to_dict(), seq, loader.used or "none", results, time.perf_counter() - started
    )


def check_base_path(base: Path, table: Table) -> None:
    """Refuse a --cache-dir that is a shard's or a table's cache directory instead of a base path.

    Caches live at <base>/<table id>-<location hash>/shard-NNNNN-of-NNNNN; handing a deeper directory would
    silently nest a second
    set of caches inside it (and, for another table's directory, mix two tables' caches).
    """
    if is_cache_dir(base):
        raise CacheMismatchError(
            f"{base} is the cache directory of one shard (table {base.parent.name}); pass the "
            f"base path that holds <table id>-<hash>/shard-* directories, e.g. "
            f"{base.parent.parent}"
        )
    if any(is_cache_dir(p) for p in base.glob("shard-*")):
        owner = "this table" if base.name == table_cache_dir_name(table) else f"table {base.name}, not {table.uri}"
        raise CacheMismatchError(
            f"{base} holds the shard caches of {owner}; pass its parent {base.parent} as the base path"
        )


def bootstrap(
    table: Table,
    days: int | None = None,
    shards: Sequence[int] | None = None,
    now: Any = None,
    config: CacheConfig | None = None,
    base_path: str | Path | None = None,
    pattern: str | None = None,
    parallelism: str = "auto",
    workers: int | None = None,
    progress: Progress | None = None,
    flush_interval_s: float = 1.0,
) -> BootstrapResult:
    """Open the caches of the given shards (None = all) under the base path, bootstrap them, close them.

    What `dbidx cache bootstrap` runs; in a long-lived process, open the caches yourself and call bootstrap_caches().
    """
    config = config or CacheConfig()
    if base_path is not None:
        check_base_path(Path(base_path), table)
    caches = [RecordIndexCache.for_table(table, s, config, base_path) for s in resolve_shards(table, shards)]
    opened: list[RecordIndexCache] = []
    try:
        for cache in caches:
            opened.append(cache.open())
        return bootstrap_caches(opened, table, days, now, pattern, parallelism, workers, progress, flush_interval_s)
    finally:
        for cache in opened:
            cache.close()
