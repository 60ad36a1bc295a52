"""ChangePlan: what a run of committed index entries does to one column family, computed a whole batch at a time.

Catch-up applies thousands to millions of entries per sync. Walking them one by one in Python (look up the old
value, compare, count, put) costs ~2 us an entry and made a warm restart after many commits only a few times faster
than a full re-bootstrap. Within one catch-up range only each key's *last* entry decides its final state, so the
entries are first reduced to one per key (a stable sort by key, the last of each run of one key kept); after that no
key depends on another and every step is a vectorised pass: numpy masks over object arrays, Counter over locations.

ExactChanges skips even the read: a partitioned table's entries each say what they change (see exact_changes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import string_sort_indices


@dataclass(frozen=True)
class ChangePlan:
    """The puts, deletes and counter movements that bring a column family to the entries' final state."""

    put_keys: list[bytes]
    put_locations: list[str]
    delete_keys: list[bytes]
    entries_delta: int  # net change of the partition's entry count
    fills_delta: Counter  # net change of live keys per location

    @property
    def changed(self) -> int:
        return len(self.put_keys) + len(self.delete_keys)


def sorted_with_last(keys: pa.Array) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """(order, keys in that order, whether each is its key's last entry): a stable sort by key, so a repeated key's
    entries stay in commit order and the last of its run is its final one."""
    n = len(keys)
    order = string_sort_indices(keys) if n else np.zeros(0, dtype=np.int64)
    ordered = keys.take(pa.array(order))
    last = np.ones(n, dtype=bool)
    if n > 1:
        last[:-1] = pc.not_equal(ordered.slice(0, n - 1), ordered.slice(1)).to_numpy(zero_copy_only=False)
    return order, ordered, last


def last_per_key(
    keys: pa.Array, locations: Sequence[str | None], deleted: Sequence[bool]
) -> tuple[list[bytes], list[str | None], np.ndarray]:
    """Each key's last effective entry (keys: encoded, Arrow binary), keys sorted (sorted multi-gets and writes
    are markedly faster).

    An entry that is neither a delete nor carries a location changes nothing, so it must not hide an earlier one.
    """
    location_array = np.empty(len(locations), dtype=object)
    location_array[:] = locations
    deleted_array = np.asarray(deleted, dtype=bool)
    # 1. Positions of the effective entries (a non-delete without a location is rare: skip the work without one).
    effective = deleted_array | np.not_equal(location_array, None).astype(bool)
    positions = np.arange(len(keys), dtype=np.int64)
    if not effective.all():
        positions = positions[effective]
    if not len(positions):
        return [], [], np.zeros(0, dtype=bool)
    # 2. Sorted by key; the last entry of each run of one key wins, as in commit order. No Python object per entry
    #    until the final keys are listed.
    order, ordered, last = sorted_with_last(keys.take(pa.array(positions)))
    final = positions[order[last]]
    return ordered.filter(pa.array(last)).to_pylist(), location_array[final].tolist(), deleted_array[final]


def plan_changes(
    keys: Sequence[bytes],
    locations: Sequence[str | None],
    deleted: np.ndarray,
    old_values: Sequence[bytes | None],
    decode: Callable[[bytes], str],
) -> ChangePlan:
    """Compare each key's final entry with what the family holds now (`old_values`, aligned with `keys`).

    Idempotent by construction: an entry the family already reflects (same location, or a delete of an absent key)
    produces no write, which keeps replays after a crash harmless.
    """
    n = len(keys)
    if n == 0:
        return ChangePlan([], [], [], 0, Counter())
    # 1. Old locations, as objects so numpy compares them element-wise in C.
    old_locs = np.empty(n, dtype=object)
    old_locs[:] = [None if raw is None else decode(raw) for raw in old_values]
    new_locs = np.empty(n, dtype=object)
    new_locs[:] = locations
    key_array = np.empty(n, dtype=object)
    key_array[:] = keys
    present = np.not_equal(old_locs, None)
    # 2. Deletes of present keys; puts where the location differs (a new key's old location is None).
    delete_mask = deleted & present
    put_mask = ~deleted & np.not_equal(new_locs, old_locs).astype(bool)
    # 3. Counters move by the net change: entries by presence, fills by location.
    fills_delta = Counter(new_locs[put_mask].tolist())
    fills_delta.subtract(old_locs[(put_mask | delete_mask) & present].tolist())
    return ChangePlan(
        put_keys=key_array[put_mask].tolist(),
        put_locations=new_locs[put_mask].tolist(),
        delete_keys=key_array[delete_mask].tolist(),
        entries_delta=int(np.count_nonzero(put_mask & ~present)) - int(np.count_nonzero(delete_mask)),
        fills_delta=fills_delta,
    )


@dataclass(frozen=True)
class ExactChanges:
    """Entries whose effect on a family is known without reading it: each insert adds a key the family does not
    hold, each tombstone removes one it holds, at the location the entry names."""

    keys: list[bytes]  # sorted, a key's entries in commit order (the last one wins, as in a write batch)
    locations: list[str]  # the distinct locations the entries name
    codes: np.ndarray  # each entry's location, as an index into `locations` (a tombstone's: the one it removes)
    deleted: np.ndarray
    entries_delta: int
    fills_delta: Counter
    last: np.ndarray  # each key's last entry (what an SST, which holds a key once, takes)

    @property
    def changed(self) -> int:
        return len(self.keys)


def exact_changes(keys: pa.Array, locations: pa.Array, deleted: np.ndarray) -> ExactChanges | None:
    """Counter movements summed over the entries themselves (None if an entry names no location: only a read can
    say what it changes).

    Why this holds for a partitioned table's committed entries: a key's location in a partition never changes
    (an update in place writes no index entry), so an insert entry is only ever written for a key the partition
    does not hold and a tombstone only for one it holds, at that location; the commit protocol refuses two
    writers' entries for one key. Applied in commit order from the state the family held at the range's start,
    every entry therefore moves the counters by exactly +1 or -1 at its own location, whatever follows it.
    """
    n = len(keys)
    if locations.null_count:
        return None
    # 1. Fills: +1 per insert and -1 per tombstone at the entry's location, summed over location codes.
    encoded = locations.dictionary_encode()
    names: list[str] = encoded.dictionary.to_pylist()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    moves = np.bincount(codes, weights=np.where(deleted, -1, 1), minlength=len(names)).astype(np.int64)
    fills = Counter({loc: int(m) for loc, m in zip(names, moves.tolist()) if m})
    removed = int(np.count_nonzero(deleted))
    # 2. Key order (RocksDB takes sorted writes ~3x faster), each key's last entry marked for an SST.
    order, ordered, last = sorted_with_last(keys)
    return ExactChanges(
        keys=ordered.to_pylist(),
        locations=names,
        codes=codes[order],
        deleted=deleted[order],
        entries_delta=(n - removed) - removed,
        fills_delta=fills,
        last=last,
    )
