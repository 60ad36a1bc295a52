"""The overlay: entries assigned by instants that have not completed yet, served before committed ones.

Stored in the `_overlay` column family as `<partition>\\0<encoded key>` -> msgpack [instant, task attempt,
location], so they survive a reopen; per partition and instant, how many entries are pending is kept in memory
(rebuilt by `scan` on open). An instant's entries go when the MDT settles it: completed (catch-up has applied its
committed entries) or rolled back. The Spark upsert path does not stage entries here (tasks never write the cache:
docs/DESIGN.md section 3); library callers that tag several batches before one commit do, and the reaper never
drops a partition that still has some.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import msgpack
import numpy as np
import pyarrow as pa

from dbidx.cache.registry import damaged
from dbidx.cache.store import Store, multi_get, scan
from dbidx.errors import CacheError, InvalidInputError

OVERLAY_CF = "_overlay"


class Overlay:
    """Pending (uncommitted) entries of one open cache, and their counts per partition and instant."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, int]] = defaultdict(dict)  # partition -> instant -> entries

    @staticmethod
    def _prefix(partition: str) -> bytes:
        return partition.encode("utf-8") + b"\x00"

    @staticmethod
    def _entry(store: Store, key: bytes, raw: bytes) -> tuple[str, str, str, str]:
        """(partition, instant, attempt, location) of a stored entry, read as untrusted bytes (damage:
        CacheCorruptError)."""
        try:
            entry = msgpack.unpackb(raw, raw=False)
            if isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, str) for v in entry) \
                    and b"\x00" in key:
                return key.split(b"\x00", 1)[0].decode("utf-8"), entry[0], entry[1], entry[2]
            problem = f"not [instant, attempt, location]: {entry!r:.80}"
        except Exception as exc:  # msgpack raises several types for garbage
            problem = f"{type(exc).__name__}: {exc}"
        raise damaged(store.path, f"overlay entry {key[:80]!r}", problem)

    def scan(self, store: Store) -> None:
        """Rebuild the in-memory counts from the column family (on open; a reopened cache starts over)."""
        self._pending.clear()
        if OVERLAY_CF not in store.column_families():
            return
        for key, raw in scan(store.cf(OVERLAY_CF)):
            partition, instant = self._entry(store, key, raw)[:2]
            self._pending[partition][instant] = self._pending[partition].get(instant, 0) + 1

    def has_pending(self, partition: str) -> bool:
        """Whether a partition has entries of unsettled instants."""
        return bool(self._pending.get(partition))

    def check_droppable(self, partition: str) -> None:
        """Raise CacheError if the partition still has entries of unsettled instants (they would be lost)."""
        if self.has_pending(partition):
            raise CacheError(f"partition {partition!r} has uncommitted entries of instants "
                             f"{sorted(self.instants(partition))}; it cannot be dropped until they finish. If their "
                             "writer died, `dbidx rollback URI --all-pending` (no writer running) then `dbidx cache "
                             "sync URI` settles them")

    def instants(self, partition: str | None = None) -> dict[str, int]:
        """Instants with pending entries (of one partition or all) -> entry count."""
        if partition is not None:
            return dict(self._pending.get(partition, {}))
        total: dict[str, int] = defaultdict(int)
        for per in self._pending.values():
            for instant, n in per.items():
                total[instant] += n
        return dict(total)

    def lookup(self, store: Store, partition: str, encoded: list[bytes]) -> list[str | None]:
        """Pending location of each encoded key (None where no unsettled instant assigned one)."""
        keys = [self._prefix(partition) + k for k in encoded]
        found = multi_get(store.cf(OVERLAY_CF, create=True), keys)
        return [None if raw is None else self._entry(store, key, raw)[3] for key, raw in zip(keys, found)]

    def resolve(self, store: Store, partition: str, encoded: pa.Array,
                result: list[str | None]) -> tuple[int, np.ndarray | None]:
        """Fill `result` (aligned with `encoded`) with pending locations; returns how many were found and the
        positions left for the committed entries (None: all of them, nothing is pending in the partition)."""
        if not self.has_pending(partition):
            return 0, None
        rest, hits = [], 0
        for i, location in enumerate(self.lookup(store, partition, encoded.to_pylist())):
            if location is None:
                rest.append(i)
            else:
                result[i] = location
                hits += 1
        return hits, np.asarray(rest, dtype=np.int64)

    def put(self, store: Store, instant: str, partition: str, encoded: Sequence[bytes], locations: Sequence[str],
            attempt: str | int) -> int:
        """Stage locations of an instant (the last per key wins); returns entries newly owned by the instant."""
        # 0. Only what _entry reads back: an instant name, an attempt, a location per key (all strings).
        if len(encoded) != len(locations):
            raise InvalidInputError(f"{len(encoded)} keys but {len(locations)} locations")
        if not isinstance(instant, str) or not instant:
            raise InvalidInputError(f"overlay instant must be a non-empty string, got {instant!r}")
        attempt = str(attempt)  # Spark attempt numbers are ints; finish() compares them the same way
        bad = [loc for loc in locations if not isinstance(loc, str) or not loc]
        if bad:
            raise InvalidInputError(f"overlay locations must be non-empty strings, got {bad[0]!r} for instant "
                                    f"{instant}")
        prefix = self._prefix(partition)
        handle = store.handle(OVERLAY_CF)
        batch = store.batch()
        existing = multi_get(store.cf(OVERLAY_CF), [prefix + k for k in encoded])
        # 1. Last write per key wins (within the batch too); count entries per owning instant exactly.
        latest: dict[bytes, str] = {}
        previous_owner: dict[bytes, str | None] = {}
        for key, loc, old in zip(encoded, locations, existing):
            latest[key] = loc
            if key not in previous_owner:
                previous_owner[key] = None if old is None else self._entry(store, prefix + key, old)[1]
        per = self._pending[partition]
        added = 0
        for key, loc in latest.items():
            batch.put(prefix + key, msgpack.packb([instant, attempt, loc]), handle)
            owner = previous_owner[key]
            if owner == instant:
                continue
            if owner is not None:  # the key moves from another pending instant to this one
                per[owner] -= 1
                if per[owner] <= 0:
                    del per[owner]
            added += 1
        store.write(batch)
        per[instant] = per.get(instant, 0) + added
        return added

    def finish(self, store: Store, instant: str, attempt: str | int | None = None) -> int:
        """Remove an instant's entries (all, or one task attempt's); returns how many."""
        overlay = store.cf(OVERLAY_CF, create=True)
        handle = store.handle(OVERLAY_CF)
        removed: dict[str, int] = defaultdict(int)
        batch = store.batch()
        for key, raw in scan(overlay):
            partition, entry_instant, entry_attempt, _loc = self._entry(store, key, raw)
            if entry_instant == instant and (attempt is None or entry_attempt == str(attempt)):
                batch.delete(key, handle)
                removed[partition] += 1
        store.write(batch)
        for partition, n in removed.items():
            per = self._pending.get(partition, {})
            left = per.get(instant, 0) - n
            if left > 0 and attempt is not None:
                per[instant] = left
            else:
                per.pop(instant, None)
            if not per:
                self._pending.pop(partition, None)
        return sum(removed.values())
