"""On-demand loading: every cold partition of a batch is loaded concurrently before tagging starts (docs/BOOTSTRAP.md).

RFC-107 loads a cold partition synchronously when the first record for it arrives, so a batch touching five old
partitions stalls five times in a row (its review comment on stalls). Here the tagger hands over the batch's
partitions once; all the cold ones load at the same time, and the batch waits once, for the slowest. Concurrent
callers sharing one loader (threads tagging other batches of the same shard) that need a partition already being
loaded wait for that load instead of starting a second one (single flight). Stalls are counted in the cache's
metrics. A loader belongs to whoever holds the cache open (a Spark task session,
spark_integration/shard_sessions.py), which closes it with the cache.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.errors import CacheCorruptError
from dbidx.table.facade import Table


@dataclass
class OnDemandReport:
    """What one ensure_loaded() call did and how long the caller waited."""

    loaded: list[str] = field(default_factory=list)  # loads this call started
    joined: list[str] = field(default_factory=list)  # loads another caller had started
    entries: int = 0
    stall_seconds: float = 0.0
    load_seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return dict(vars(self))


class OnDemandLoader:
    """Loads cold partitions of one open shard cache from the index, concurrently and at most once at a time."""

    def __init__(
        self,
        cache: RecordIndexCache,
        table: Table,
        workers: int | None = None,
        on_build_start: Callable[[str], None] | None = None,
        on_join: Callable[[str], None] | None = None,
    ) -> None:
        """workers: loads at once (default: the cache's `load.threads`, CacheConfig.on_demand_workers).
        Instrumentation hooks: on_build_start(partition) runs in the loading thread before the read;
        on_join(partition) runs in a caller that found the partition's load already in flight, before it waits."""
        self.cache = cache
        self.table = table
        self.on_build_start = on_build_start
        self.on_join = on_join
        self.workers = max(1, cache.config.on_demand_workers if workers is None else workers)
        self.closed = False
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dbidx-on-demand")
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the loading threads (waits for running loads)."""
        self._pool.shutdown(wait=True)
        self.closed = True

    def __enter__(self) -> "OnDemandLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def ensure_loaded(self, partitions: Iterable[str]) -> OnDemandReport:
        """Return once every given partition is ready; loads the cold ones concurrently. Raises a load's error."""
        started = time.perf_counter()
        report = OnDemandReport()
        wanted = self.cache.not_ready(partitions)
        if not wanted:
            return report
        # 1. Start a load for each cold partition nobody is loading yet; join the ones in flight.
        seq = self.table.refresh().applied_seq  # the view's seq: a thread sharing the table may move the timeline
        futures: dict[str, Future] = {}
        with self._lock:
            for partition in wanted:
                if self.cache.is_ready(partition):
                    continue
                future = self._inflight.get(partition)
                if future is None:
                    future = self._inflight[partition] = self._pool.submit(self._load, partition, seq)
                    report.loaded.append(partition)
                else:
                    report.joined.append(partition)
                futures[partition] = future
        if self.on_join is not None:
            for partition in report.joined:
                self.on_join(partition)
        # 2. Wait once for all of them; the batch stalls for the slowest load, not for their sum.
        wait(list(futures.values()))
        errors = []
        for partition, future in futures.items():
            exc = future.exception()
            if exc is not None:
                errors.append(exc)
            elif partition in report.loaded:
                entries, seconds = future.result()
                report.entries += entries
                report.load_seconds[partition] = seconds
        report.stall_seconds = time.perf_counter() - started
        self.cache.metrics.add(on_demand_loads=len(report.loaded), stall_seconds=report.stall_seconds)
        if errors:  # damage first: the task session discards a damaged cache only when it sees the damage
            raise next((e for e in errors if isinstance(e, CacheCorruptError)), errors[0])
        return report

    def _load(self, partition: str, seq: int) -> tuple[int, float]:
        """Build and install one partition (in a loader thread); always leaves the in-flight map."""
        started = time.perf_counter()
        try:
            if self.on_build_start is not None:
                self.on_build_start(partition)
            # The caller's refresh found `seq` in the shared view: this thread reads that view, listing nothing.
            with self.table.pinned(refreshed=True):
                entries = load_from_snapshot(self.cache, self.table, partition, seq)
            seconds = time.perf_counter() - started
            self.cache.metrics.add_to_partition(partition, on_demand_loads=1, stall_seconds=seconds)
            return entries, seconds
        finally:
            with self._lock:
                self._inflight.pop(partition, None)
