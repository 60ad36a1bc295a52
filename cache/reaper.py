"""The TTL reaper: keeps a cache bounded by dropping cold partitions (O(1) each: drop the column family).

Rule (seed 000): a partition with uncommitted overlay entries is never dropped, whatever its age, because its
pending entries are the only record of keys assigned by an in-flight instant. Everything else goes in two passes:
1. TTL: partitions not accessed for `partition_ttl_hours`;
2. budget: then least-recently-used partitions while the directory exceeds `max_disk_mb` (0 = no budget).
A dropped partition is simply reloaded on demand the next time a batch touches it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dbidx.cache.record_cache import RecordIndexCache

log = logging.getLogger(__name__)


@dataclass
class ReapResult:
    """What one reaper pass dropped (or, in a dry run, would drop) and why."""

    dropped_ttl: list[str] = field(default_factory=list)
    dropped_budget: list[str] = field(default_factory=list)
    kept_pending: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    dry_run: bool = False

    @property
    def dropped(self) -> list[str]:
        """All partitions dropped by this pass."""
        return self.dropped_ttl + self.dropped_budget

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {**vars(self), "dropped": self.dropped}


def reap(
    cache: RecordIndexCache,
    ttl_hours: float | None = None,
    max_disk_mb: int | None = None,
    dry_run: bool = False,
    now_ms: int | None = None,
) -> ReapResult:
    """Drop expired partitions, then LRU partitions over the disk budget; never one with pending entries."""
    ttl = cache.config.partition_ttl_hours if ttl_hours is None else ttl_hours
    budget_mb = cache.config.max_disk_mb if max_disk_mb is None else max_disk_mb
    now = int(time.time() * 1000) if now_ms is None else now_ms
    result = ReapResult(dry_run=dry_run, bytes_before=cache.disk_bytes())
    states = cache.partitions()
    pending = {p for p in states if cache.pending_instants(p)}
    result.kept_pending = sorted(pending)
    # 1. TTL pass, oldest first.
    cutoff = now - int(ttl * 3600 * 1000)
    by_age = sorted((s for p, s in states.items() if p not in pending), key=lambda s: s.last_access_ms)
    survivors = []
    for state in by_age:
        if state.last_access_ms < cutoff:
            result.dropped_ttl.append(state.partition)
        else:
            survivors.append(state)
    # 2. Budget pass: LRU among the survivors while the (estimated) size is over budget.
    if budget_mb > 0:
        sizes = {s.partition: cache.disk_bytes(s.partition) for s in survivors}
        total = result.bytes_before - sum(cache.disk_bytes(p) for p in result.dropped_ttl)
        for state in survivors:
            if total <= budget_mb << 20:
                break
            result.dropped_budget.append(state.partition)
            total -= sizes[state.partition]
    # 3. Drop (each is one column-family drop), unless this is a dry run.
    if not dry_run:
        for partition in result.dropped:
            cache.drop_partition(partition)
        if result.dropped:
            cache.flush()
        cache.metrics.add(evictions=len(result.dropped))
    result.bytes_after = cache.disk_bytes() if not dry_run else result.bytes_before
    return result


class BackgroundReaper:
    """Runs reap() every `interval_s` on a daemon thread for long-lived processes; stop() ends it."""

    def __init__(self, cache: RecordIndexCache, interval_s: float | None = None,
                 on_result: Callable[[ReapResult], None] | None = None) -> None:
        self.cache = cache
        self.interval_s = cache.config.reaper_interval_s if interval_s is None else interval_s
        self.on_result = on_result
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "BackgroundReaper":
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"dbidx-reaper-{self.cache.path.name}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the thread to stop and wait for the pass in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> "BackgroundReaper":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.cache.store is None:
                return
            try:
                result = reap(self.cache)
            except Exception:  # a failed pass must not kill the thread; the next one retries
                log.exception("dbidx reaper pass on %s failed", self.cache.path)
                continue
            self.passes += 1
            if self.on_result is not None:
                self.on_result(result)
