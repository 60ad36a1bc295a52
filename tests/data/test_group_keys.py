"""A file group's older files as one merged hash index: the same hits as a membership test, as files come and go."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.data.group_keys import GroupIndexes, GroupKeys
from dbidx.data.key_columns import FileKeys, Probe

WORDS = st.text(alphabet="abcé\x00", min_size=0, max_size=6)
FILES = st.lists(st.lists(WORDS, max_size=25), min_size=0, max_size=5)


def indexed(files: list[list[str]], tag: str = "") -> dict[tuple[str, str], FileKeys]:
    return {(f"f{i}{tag}.parquet", f"c{i}"): FileKeys.of(pa.array(keys, pa.string())) for i, keys in enumerate(files)}


def per_file(indexes: dict[tuple[str, str], FileKeys], probe: Probe) -> dict[tuple[str, str], list[int]]:
    """What a plain membership test of each file's keys finds, as sorted rows per file with a hit."""
    wanted = set(probe.keys.to_pylist())
    found = {f: [i for i, k in enumerate(index.keys.to_pylist()) if k in wanted] for f, index in indexes.items()}
    return {f: rows for f, rows in found.items() if rows}


def merged_hits(merged: GroupKeys, indexes: dict[tuple[str, str], FileKeys], probe: Probe) -> dict:
    return {f: sorted(set(rows.tolist())) for f, rows in merged.rows_of(probe, indexes).items()}


@settings(max_examples=200, deadline=None)
@given(FILES, st.lists(WORDS, max_size=20))
def test_the_merged_index_finds_what_a_membership_test_finds(files: list[list[str]], wanted: list[str]) -> None:
    indexes = indexed(files)
    probe = Probe.of(pa.array(wanted, pa.string()))
    merged = GroupKeys.of(list(indexes), list(indexes.values()))
    assert merged_hits(merged, indexes, probe) == per_file(indexes, probe)
    assert np.all(np.diff(merged.sorted_hashes.astype(np.int64)) >= 0)
    assert len(merged.sorted_hashes) == sum(len(keys) for keys in files)


@settings(max_examples=100, deadline=None)
@given(FILES, FILES, st.lists(WORDS, max_size=20))
def test_a_kept_index_grows_by_new_files_and_is_merged_anew_when_files_leave(
    first: list[list[str]], later: list[list[str]], wanted: list[str]
) -> None:
    """Batch by batch a group gains files (merged into the kept index); a compaction takes files away (merged anew)."""
    groups = GroupIndexes(max_bytes=1 << 20)
    probe = Probe.of(pa.array(wanted, pa.string()))
    before = indexed(first)
    grown = before | indexed(later, tag="-later")
    for files in (before, grown):
        merged = groups.of(("root", "p", "g"), files)
        assert set(merged.files) == set(files)
        assert merged_hits(merged, files, probe) == per_file(files, probe)
    # A compaction: some older files gone, a new one in their place.
    after = {f: index for i, (f, index) in enumerate(grown.items()) if i % 2} | indexed([wanted[:3]], tag="-compacted")
    merged = groups.of(("root", "p", "g"), after)
    assert set(merged.files) == set(after)
    assert merged_hits(merged, after, probe) == per_file(after, probe)


def test_a_rewritten_file_under_the_same_path_is_another_file() -> None:
    """The identity is (path, checksum): a kept index of the old bytes is never used for the new ones."""
    groups = GroupIndexes(max_bytes=1 << 20)
    old = {("f.parquet", "c1"): FileKeys.of(pa.array(["a", "b"], pa.string()))}
    new = {("f.parquet", "c2"): FileKeys.of(pa.array(["b", "c"], pa.string()))}
    groups.of(("root", "p", "g"), old)
    merged = groups.of(("root", "p", "g"), new)
    assert merged.files == (("f.parquet", "c2"),)
    hits = merged.rows_of(Probe.of(pa.array(["a", "c"], pa.string())), new)
    assert {f: rows.tolist() for f, rows in hits.items()} == {("f.parquet", "c2"): [1]}


@settings(max_examples=100, deadline=None)
@given(FILES, st.lists(WORDS, max_size=15), st.integers(1, 3))
def test_hash_collisions_across_files_are_never_hits(files: list[list[str]], wanted: list[str], buckets: int) -> None:
    """Every key of every file forced into one of a few hash values: only the key comparison tells rows apart."""

    def fake(keys: list[str]) -> FileKeys:
        hashes = np.array([len(k) % buckets for k in keys], dtype=np.uint32)
        order = np.argsort(hashes, kind="stable").astype(np.int32)
        return FileKeys(pa.array(keys, pa.string()), hashes[order], order)

    indexes = {(f"f{i}", "c"): fake(keys) for i, keys in enumerate(files)}
    probe_hashes = np.array([len(k) % buckets for k in wanted], dtype=np.uint32)
    order = np.argsort(probe_hashes, kind="stable")
    probe = Probe(pa.array(wanted, pa.string()).take(pa.array(order)), probe_hashes[order])
    expected = {
        f: sorted(i for i, k in enumerate(keys) if k in set(wanted))
        for f, keys in zip(indexes, files)
        if set(keys) & set(wanted)
    }
    merged = GroupKeys.of(list(indexes), list(indexes.values()))
    assert merged_hits(merged, indexes, probe) == expected
    # The same files merged one at a time (each batch's new file into the kept order): the same hits.
    grown = GroupKeys.of([], [])
    for f, index in indexes.items():
        grown = grown.grown([f], [index])
    assert np.all(np.diff(grown.sorted_hashes.astype(np.int64)) >= 0)
    assert merged_hits(grown, indexes, probe) == expected


def test_threads_searching_one_group_at_once_each_get_exact_hits() -> None:
    """A thread that finds the group's kept index taken by another merges its own: never a mix of file sets."""
    groups = GroupIndexes(max_bytes=1 << 20)
    keys = [[f"k{t}-{i}" for i in range(200)] for t in range(6)]
    probe = Probe.of(pa.array([k for ks in keys for k in ks[::7]], pa.string()))
    errors: list[BaseException] = []

    def search(upto: int) -> None:
        try:
            for _ in range(50):
                files = indexed(keys[:upto])
                assert merged_hits(groups.of(("root", "p", "g"), files), files, probe) == per_file(files, probe)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=search, args=(upto,)) for upto in (2, 4, 6, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_the_kept_indexes_stay_within_their_budget() -> None:
    one = {("a", "c"): FileKeys.of(pa.array([f"k{i}" for i in range(100)], pa.string()))}
    size = GroupKeys.of(list(one), list(one.values())).nbytes
    groups = GroupIndexes(max_bytes=2 * size)
    for name in ("g1", "g2", "g3"):
        groups.of(("root", "p", name), one)
    assert groups._kept.nbytes <= 2 * size and len(groups._kept) == 2
