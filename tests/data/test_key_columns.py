"""The per-process key columns of data files: hash-index lookups equal a plain membership test, collisions included."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.data.group_keys import GroupKeys
from dbidx.data.key_columns import FileKeys, KeyColumns, Probe
from dbidx.storage.records import DataFileRecord

WORDS = st.text(alphabet="abcé\x00", min_size=0, max_size=6)


def rows_in(index: FileKeys, probe: Probe) -> np.ndarray:
    """The rows of one indexed file a probe finds (the search upserts run, over a group of this one file)."""
    only = ("f.parquet", "c")
    return GroupKeys.of([only], [index]).rows_of(probe, {only: index}).get(only, np.empty(0, np.int32))


def expected(file_keys: list[str], wanted: list[str]) -> list[int]:
    mask = pc.is_in(pa.array(file_keys, pa.string()), value_set=pa.array(wanted, pa.string()))
    return np.flatnonzero(mask.to_numpy(zero_copy_only=False)).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(WORDS, max_size=40), st.lists(WORDS, max_size=20))
def test_rows_of_equals_membership(file_keys: list[str], wanted: list[str]) -> None:
    found = rows_in(FileKeys.of(pa.array(file_keys, pa.string())), Probe.of(pa.array(wanted, pa.string())))
    assert sorted(set(found.tolist())) == expected(file_keys, wanted)


@settings(max_examples=200, deadline=None)
@given(st.lists(WORDS, max_size=40), st.lists(st.lists(WORDS, max_size=12), min_size=1, max_size=4))
def test_a_probe_of_indexed_files_finds_what_a_probe_of_their_keys_finds(
    file_keys: list[str], new_files: list[list[str]]
) -> None:
    """Probe.of_files (a writer's new files, hashed once when indexed) equals Probe.of over their keys."""
    indexed = [FileKeys.of(pa.array(keys, pa.string())) for keys in new_files]
    probe = Probe.of_files(indexed)
    flat = [k for keys in new_files for k in keys]
    assert np.all(np.diff(probe.hashes.astype(np.int64)) >= 0)
    assert sorted(probe.keys.to_pylist()) == sorted(flat)
    index = FileKeys.of(pa.array(file_keys, pa.string()))
    assert sorted(rows_in(index, probe).tolist()) == sorted(
        rows_in(index, Probe.of(pa.array(flat, pa.string()))).tolist()
    )
    assert sorted(set(rows_in(index, probe).tolist())) == expected(file_keys, flat)


@settings(max_examples=100, deadline=None)
@given(st.lists(WORDS, max_size=30), st.lists(WORDS, max_size=15), st.integers(1, 3))
def test_hash_collisions_are_never_hits(file_keys: list[str], wanted: list[str], buckets: int) -> None:
    """Every key forced into one of a few hash values: only the key comparison tells rows apart."""

    def fake_hash(keys: list[str]) -> np.ndarray:
        return np.array([len(k) % buckets for k in keys], dtype=np.uint32)

    hashes = fake_hash(file_keys)
    order = np.argsort(hashes, kind="stable").astype(np.int32)
    index = FileKeys(pa.array(file_keys, pa.string()), hashes[order], order)
    probe_hashes = fake_hash(wanted)
    probe_order = np.argsort(probe_hashes, kind="stable")
    probe = Probe(pa.array(wanted, pa.string()).take(pa.array(probe_order)), probe_hashes[probe_order])
    assert sorted(set(rows_in(index, probe).tolist())) == expected(file_keys, wanted)


def test_the_cache_keeps_files_by_path_and_checksum_within_its_budget() -> None:
    def record(path: str, checksum: str = "c") -> DataFileRecord:
        return DataFileRecord(path=path, size=1, checksum=checksum, partition="p", file_group="g", rows=3)

    keys = pa.array(["a", "b", "c"], pa.string())
    one = FileKeys.of(keys).nbytes
    cache = KeyColumns(max_bytes=2 * one)
    reads: list[str] = []

    def read(r: DataFileRecord) -> pa.Array:
        reads.append(r.path)
        return keys

    for path in ("x", "y", "x", "z", "y"):
        assert cache.get(record(path), read).keys.equals(keys)
    assert reads == ["x", "y", "z", "y"]  # x was used again before z came, so y was the one dropped
    assert cache.find(record("x", checksum="other")) is None  # a rewritten file is another file
