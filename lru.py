"""A least-recently-used map bounded by the bytes of its values: what a process keeps of data it can always make
again (data files' key indexes, inline vector forms), so memory stays within a budget whatever the table's size."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BytesLRU(Generic[K, V]):
    """Values by key with their sizes; past `max_bytes` the least recently used go, but never the newest one (a
    single value over the budget is still kept until the next). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value kept for `key` (marked recently used), or None."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            self._items.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V, size: int) -> V:
        """Keep `value` for `key` unless one is kept already; returns the one kept (the earlier one, if any)."""
        with self._lock:
            known = self._items.get(key)
            if known is not None:
                return known[0]
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped
            return value

    def pop(self, key: K) -> V | None:
        """Remove and return the value kept for `key` (None if there is none)."""
        with self._lock:
            found = self._items.pop(key, None)
            if found is None:
                return None
            self._bytes -= found[1]
            return found[0]

    @property
    def nbytes(self) -> int:
        """The sizes of the values kept, summed."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
