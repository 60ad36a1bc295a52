"""Counters of one cache (F30): lookups, hits, misses, loads and their stall time, catch-up, evictions."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class PartitionCounters:
    """Counters of one partition."""

    hits: int = 0
    pending_hits: int = 0
    misses: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    on_demand_loads: int = 0
    stall_seconds: float = 0.0
    catchup_entries: int = 0


@dataclass
class CacheMetrics:
    """Counters of one cache instance since it was opened; thread-safe to update."""

    lookups: int = 0
    hits: int = 0
    pending_hits: int = 0
    misses: int = 0
    loads: int = 0
    loaded_entries: int = 0
    load_seconds: float = 0.0
    on_demand_loads: int = 0
    stall_seconds: float = 0.0  # wall time tagging waited for on-demand loads
    catchup_entries: int = 0
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

    def add(self, partition: str | None = None, **deltas: float) -> None:
        """Add to totals and, when a partition is named, to its counters (same field names)."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)
            per_partition = {n: d for n, d in deltas.items() if hasattr(PartitionCounters, n)}
            if partition is not None and per_partition:
                self._bump(partition, per_partition)

    def add_to_partition(self, partition: str, **deltas: float) -> None:
        """Add to one partition's counters only (when the total is accounted differently, e.g. wall-clock stall)."""
        with self._lock:
            self._bump(partition, deltas)

    def _bump(self, partition: str, deltas: dict[str, float]) -> None:
        """Add to a partition's counters (caller holds the lock)."""
        counters = self.partition(partition)
        for name, delta in deltas.items():
            setattr(counters, name, getattr(counters, name) + delta)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for JSON output and Spark job results)."""
        with self._lock:
            data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("_lock", "per_partition")}
            data["per_partition"] = {name: asdict(c) for name, c in sorted(self.per_partition.items())}
        return data
