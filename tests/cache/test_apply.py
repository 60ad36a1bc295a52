"""Catch-up's batch apply against a one-entry-at-a-time reference: same final map, counters and idempotence."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.cache import change_writes, registry
from dbidx.cache.changes import last_per_key, plan_changes
from dbidx.cache.codec import encode_keys_binary
from dbidx.table.facade import Table

from tests.cache_helpers import DAY1, make_table, open_cache

# A small key space (so batches repeat keys and hit loaded ones) over every key class the codec knows.
KEYS = (
    [f"k{i}" for i in range(12)]
    + [f"{i:020d}" for i in range(6)]
    + [f"00000000-0000-4000-8000-{i:012x}" for i in range(6)]
)
LOCATIONS = ["fg-a", "fg-b", "fg-c", "fg-new"]

entry = st.tuples(st.sampled_from(KEYS), st.one_of(st.none(), st.sampled_from(LOCATIONS)), st.booleans())


def sequential(state: dict[str, str], entries: list[tuple[str, str | None, bool]]) -> dict[str, str]:
    """The reference: entries applied one by one, in commit order."""
    state = dict(state)
    for key, location, deleted in entries:
        if deleted:
            state.pop(key, None)
        elif location is not None:
            state[key] = location
    return state


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Table:
    return make_table(tmp_path_factory.mktemp("apply"), num_shards=1, keys_per_day=10)


@given(
    initial=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(LOCATIONS[:3]), max_size=15),
    entries=st.lists(entry, max_size=40),
)
@pytest.mark.slow
@settings(max_examples=60, deadline=None)
def test_apply_matches_one_entry_at_a_time(table, initial, entries):
    with tempfile.TemporaryDirectory() as base, open_cache(table, 0, Path(base)) as cache:
        cache.load_partition(DAY1, list(initial), list(initial.values()), synced_seq=1)
        keys = [k for k, _, _ in entries]
        locations = [loc for _, loc, _ in entries]
        deleted = [gone for _, _, gone in entries]
        expected = sequential(initial, entries)

        changed = cache.apply(DAY1, keys, locations, deleted, synced_seq=2)

        assert dict(cache.items(DAY1)) == expected
        assert cache.partitions()[DAY1].entries == len(expected)
        assert cache.fills(DAY1) == dict(Counter(expected.values()))
        assert cache.partitions()[DAY1].synced_seq == 2
        # Net changes only: keys whose final state differs from where they started.
        assert changed == sum(1 for k in set(initial) | set(expected) if initial.get(k) != expected.get(k))
        # Idempotent: replaying the same entries (as after a crash) writes nothing.
        assert cache.apply(DAY1, keys, locations, deleted, synced_seq=2) == 0
        assert dict(cache.items(DAY1)) == expected


def test_last_per_key_keeps_the_last_effective_entry_sorted():
    keys = encode_keys_binary(pa.array(["b", "a", "b", "c", "a"]))
    unique, locations, deleted = last_per_key(
        keys, ["fg-1", "fg-2", "fg-3", None, None], [False, False, False, False, True]
    )
    # "c" only has a no-op entry (no location, not a delete): it is dropped; "a" ends deleted; "b" at fg-3.
    assert unique == sorted(encode_keys_binary(pa.array(["a", "b"])).to_pylist())
    assert dict(zip(unique, zip(locations, deleted.tolist()))) == {
        encode_keys_binary(pa.array(["a"]))[0].as_py(): (None, True),
        encode_keys_binary(pa.array(["b"]))[0].as_py(): ("fg-3", False),
    }


def test_plan_moves_counters_by_the_net_change():
    decode = {b"1": "fg-a", b"2": "fg-b"}.__getitem__
    plan = plan_changes(
        [b"k1", b"k2", b"k3", b"k4"],
        ["fg-b", None, "fg-b", "fg-c"],
        np.array([False, True, False, True]),
        [b"1", b"2", b"2", None],
        decode,
    )
    # k1 moves a -> b, k2 is deleted, k3 is already at b, k4's delete finds nothing.
    assert plan.put_keys == [b"k1"] and plan.put_locations == ["fg-b"] and plan.delete_keys == [b"k2"]
    assert plan.entries_delta == -1
    assert {loc: n for loc, n in plan.fills_delta.items() if n} == {"fg-a": -1}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "dd", "é", "a\x00"]), st.sampled_from(["fg-1", "fg-2", None]), st.booleans()
        ),
        max_size=30,
    ),
    st.integers(1, 80),
)
def test_last_per_key_equals_a_plain_replay(entries: list, spread: int) -> None:
    """Against a dict replay of the entries in order (no-op entries skipped), with enough distinct keys to take the
    fast sort (the key set is widened by `spread` copies with suffixes)."""
    entries = [(f"{k}{i % spread}", loc, dead) for i, (k, loc, dead) in enumerate(entries * 40)]
    expected: dict[bytes, tuple] = {}
    encoded = encode_keys_binary(pa.array([k for k, _, _ in entries], pa.string()))
    for raw, (_k, loc, dead) in zip(encoded.to_pylist(), entries):
        if dead or loc is not None:
            expected[raw] = (loc, dead)
    unique, locations, deleted = last_per_key(encoded, [loc for _, loc, _ in entries], [d for _, _, d in entries])
    assert unique == sorted(expected)
    assert dict(zip(unique, zip(locations, deleted.tolist()))) == expected


# A partitioned table's committed entries: an insert only of a key the partition does not hold, a tombstone only of
# one it holds, naming its location (a key's location never changes in place). Drawn as a walk over the key space.
step = st.tuples(st.sampled_from(KEYS), st.sampled_from(LOCATIONS))


def committed_walk(initial: dict[str, str], steps: list[tuple[str, str]]) -> list[tuple[str, str, bool]]:
    """Entries a partitioned table could commit from `initial`: each step inserts its key where it is absent and
    deletes it (at its current location) where it is present."""
    state, entries = dict(initial), []
    for key, location in steps:
        if key in state:
            entries.append((key, state.pop(key), True))
        else:
            state[key] = location
            entries.append((key, location, False))
    return entries


@pytest.mark.parametrize("sst_from", [10**9, 1], ids=["write-batch", "sst"])
@given(
    initial=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(LOCATIONS[:3]), max_size=15),
    steps=st.lists(step, max_size=40),
)
@pytest.mark.slow
@settings(max_examples=60, deadline=None)
def test_apply_exact_matches_one_entry_at_a_time(table, sst_from, initial, steps):
    """Without reading the family, the same final map and the same counters as the reference, whether the changes
    go through a write batch or (large ones) one ingested SST holding each key's last change."""
    entries = committed_walk(initial, steps)
    with tempfile.TemporaryDirectory() as base, open_cache(table, 0, Path(base)) as cache, _sst_from(sst_from):
        cache.load_partition(DAY1, list(initial), list(initial.values()), synced_seq=1)
        expected = sequential(initial, entries)

        changed = cache.apply_exact(
            DAY1,
            pa.array([k for k, _, _ in entries], pa.string()),
            pa.array([loc for _, loc, _ in entries], pa.string()),
            np.array([gone for _, _, gone in entries], dtype=bool),
            synced_seq=2,
        )

        assert dict(cache.items(DAY1)) == expected
        assert cache.partitions()[DAY1].entries == len(expected)
        assert cache.fills(DAY1) == dict(Counter(expected.values()))
        assert cache.partitions()[DAY1].synced_seq == 2
        assert changed == len(entries)


@contextmanager
def _sst_from(entries: int):
    """apply_exact's SST threshold set to `entries` for a block."""
    chosen, change_writes.SST_APPLY_MIN_ENTRIES = change_writes.SST_APPLY_MIN_ENTRIES, entries
    try:
        yield
    finally:
        change_writes.SST_APPLY_MIN_ENTRIES = chosen


def test_apply_exact_by_sst_keeps_new_locations_after_a_reopen(table, tmp_path):
    """A large catch-up that names a location the family has not seen writes the extended dictionary into its SST:
    after a clean reopen (the registry flushed, the SST durable on its own) every value still decodes."""
    keys = [f"n{i:06d}" for i in range(20_000)]
    with open_cache(table, 0, tmp_path) as cache:
        cache.load_partition(DAY1, ["k0", "k1"], ["fg-a", "fg-a"], synced_seq=1)
        cache.apply_exact(
            DAY1,
            pa.array(keys + ["k0"]),
            pa.array(["fg-new"] * len(keys) + ["fg-a"]),
            np.array([False] * len(keys) + [True]),
            synced_seq=2,
        )
        assert not any(cache.scratch_dir.iterdir())  # the scratch SST was moved into the family
    with open_cache(table, 0, tmp_path) as reopened:
        assert not reopened.recovered
        assert dict(reopened.items(DAY1)) == {"k1": "fg-a", **{k: "fg-new" for k in keys}}
        assert reopened.fills(DAY1) == {"fg-a": 1, "fg-new": len(keys)}
        assert reopened.partitions()[DAY1].entries == len(keys) + 1


def test_apply_exact_reads_first_when_an_entry_names_no_location(table, tmp_path):
    """An entry without a location says nothing about what it changes: the read-first apply takes the batch."""
    with open_cache(table, 0, tmp_path) as cache:
        cache.load_partition(DAY1, ["k0", "k1"], ["fg-a", "fg-a"], synced_seq=1)
        # "k0" inserted again at fg-b (its location moves: only a read sees the old one), "k1" a no-op entry.
        cache.apply_exact(
            DAY1, pa.array(["k0", "k1"]), pa.array(["fg-b", None], pa.string()), np.array([False, False]), synced_seq=2
        )
        assert dict(cache.items(DAY1)) == {"k0": "fg-b", "k1": "fg-a"}
        assert cache.fills(DAY1) == {"fg-a": 1, "fg-b": 1} and cache.partitions()[DAY1].entries == 2


def _crash_after_apply(table, path: Path, *applied: tuple[tuple, int]) -> None:
    """A cache whose partition DAY1 holds k0, k1 at fg-a plus each (entries, seq) of `applied`, left as a crash
    between the data's flush and the registry's: the data stays, the registry is back at seq 1 and the session
    still "open"."""
    cache = open_cache(table, 0, path)
    cache.load_partition(DAY1, ["k0", "k1"], ["fg-a", "fg-a"], synced_seq=1)
    for entries, seq in applied:
        cache.apply_exact(DAY1, *entries, synced_seq=seq)
    cache.flush()
    state = cache.partitions()[DAY1]
    store = cache.store
    state.entries, state.fills, state.synced_seq = 2, {"fg-a": 2}, 1
    store.write(registry.put_states(store.batch(), [state]))
    store.flush()
    store.close()
    cache.store = None


NEW = (pa.array(["k2", "k3"]), pa.array(["fg-b", "fg-b"]), np.array([False, False]))


def test_apply_exact_reads_first_after_an_unclean_shutdown(table, tmp_path):
    """A cache opened after a crash may hold entries its registry does not count yet: replaying them must not count
    them twice, so its partitions read first until caught up past what the crashed session can have applied."""
    _crash_after_apply(table, tmp_path, (NEW, 2))
    with open_cache(table, 0, tmp_path) as reopened:
        assert reopened.recovered and reopened.needs_recovery_bound
        reopened.bound_recovery(2)  # what catch-up does first: the table's newest completed seq
        reopened.apply_exact(DAY1, *NEW, synced_seq=2)  # the replay
        assert reopened.partitions()[DAY1].entries == 4
        assert reopened.fills(DAY1) == {"fg-a": 2, "fg-b": 2}
        # Read first up to the bound: the family's counters are its content's again, the next entries go exact.
        assert not reopened.needs_recovery_bound
        reopened.apply_exact(DAY1, pa.array(["k4"]), pa.array(["fg-c"]), np.array([False]), synced_seq=3)
        assert reopened.fills(DAY1) == {"fg-a": 2, "fg-b": 2, "fg-c": 1}
    with open_cache(table, 0, tmp_path) as clean:
        assert not clean.recovered  # caught up past the crash: the close was a clean one


def test_a_clean_close_before_catching_up_keeps_the_partition_unsure(table, tmp_path):
    """Opened after a crash and closed again without a catch-up (`dbidx cache stats`, a task whose sync failed):
    the next open must still know the data may be ahead, or its replay would count entries twice."""
    _crash_after_apply(table, tmp_path, (NEW, 2))
    with open_cache(table, 0, tmp_path) as looked_at:
        assert looked_at.recovered
    with open_cache(table, 0, tmp_path) as reopened:
        assert reopened.recovered  # still: nothing caught the partition up
        reopened.bound_recovery(2)
        reopened.apply_exact(DAY1, *NEW, synced_seq=2)
        assert reopened.partitions()[DAY1].entries == 4
        assert reopened.fills(DAY1) == {"fg-a": 2, "fg-b": 2}


def test_a_catch_up_short_of_the_bound_keeps_reading_first(table, tmp_path):
    """A task whose view is older than what the crashed session applied catches up only part of the way: the
    partition stays unsure, so the entries after that point (already in the data) are read first too."""
    later = (pa.array(["k4"]), pa.array(["fg-c"]), np.array([False]))
    _crash_after_apply(table, tmp_path, (NEW, 2), (later, 3))
    with open_cache(table, 0, tmp_path) as reopened:
        reopened.bound_recovery(3)
        reopened.apply_exact(DAY1, *NEW, synced_seq=2)  # a pinned view at seq 2
        assert reopened.needs_recovery_bound is False and DAY1 in reopened._unsure
        reopened.apply_exact(DAY1, *later, synced_seq=3)  # the next task's catch-up: k4 is already there
        assert reopened.partitions()[DAY1].entries == 5
        assert reopened.fills(DAY1) == {"fg-a": 2, "fg-b": 2, "fg-c": 1}
        assert DAY1 not in reopened._unsure


def test_a_dropped_partition_does_not_keep_a_recovered_cache_unsure(table, tmp_path):
    """The reaper may drop a partition a crash left unsure: nothing of it is left to count twice, so it must not keep
    the session "open" (and every later open recovering) on its own."""
    _crash_after_apply(table, tmp_path, (NEW, 2))
    with open_cache(table, 0, tmp_path) as reopened:
        assert reopened.recovered
        reopened.drop_partition(DAY1)
    with open_cache(table, 0, tmp_path) as clean:
        assert not clean.recovered
