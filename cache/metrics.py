"""Counters of one cache: lookups, hits, misses, loads and their stall time, catch-up, evictions.

All of them are `dbidx.counters.Counters` (docs/DESIGN.md, section 6 "Metrics").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from dbidx.counters import Counters


@dataclass
class CacheCounters(Counters):
    """What a cache did for lookups: the counters tasks report per shard and commits sum (TaskCounts)."""

    hits: int = 0
    misses: int = 0
    on_demand_loads: int = 0
    stall_seconds: float = 0.0  # wall time tagging waited for on-demand loads
    catchup_entries: int = 0
    staged_loads: int = 0  # partitions installed from a bulk load's staged SSTs (cache/staging.py), not reloaded


@dataclass
class PartitionCounters(CacheCounters):
    """Counters of one partition."""

    loads: int = 0
    load_seconds: float = 0.0


@dataclass
class CacheMetrics(PartitionCounters):
    """Counters of one cache instance since it was opened (totals over its partitions); thread-safe to update."""

    lookups: int = 0
    loaded_entries: int = 0
    reloads: int = 0
    syncs: int = 0
    sync_seconds: float = 0.0
    evictions: int = 0
    recoveries: int = 0
    per_partition: dict[str, PartitionCounters] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def partition(self, name: str) -> PartitionCounters:
        """The counters of one partition (created on first use)."""
        counters = self.per_partition.get(name)
        if counters is None:
            counters = self.per_partition.setdefault(name, PartitionCounters())
        return counters

    def add(self, *others: Counters, partition: str | None = None, **deltas: float) -> "CacheMetrics":
        """Add to the totals and, when a partition is named, the deltas its counters also have to them."""
        with self._lock:
            super().add(*others, **deltas)
            per_partition = {n: d for n, d in deltas.items() if n in PartitionCounters._summed()}
            if partition is not None and per_partition:
                self.partition(partition).add(**per_partition)
        return self

    def add_to_partition(self, partition: str, **deltas: float) -> None:
        """Add to one partition's counters only (when the total is accounted differently, e.g. wall-clock stall)."""
        with self._lock:
            self.partition(partition).add(**deltas)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for JSON output and Spark job results)."""
        with self._lock:
            data = super().to_dict()
            data["per_partition"] = {name: c.to_dict() for name, c in sorted(self.per_partition.items())}
        return data
