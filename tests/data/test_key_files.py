"""Key files (data/key_files.py): what one process builds another maps back equal; anything damaged or misnamed, and
forgeries with a valid checksum that a full check can see, are refused, deleted and rebuilt from the data file; the
directory keeps to its bounds, its privacy and the reaper's age."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from dbidx.data import key_files
from dbidx.data.group_keys import GroupKeys
from dbidx.data.key_columns import FileKeys, KeyColumns, KeySources, Probe
from dbidx.data.key_files import KeyFiles, sweep_unused
from dbidx.storage.records import DataFileRecord


def record(rows: int, n: int = 0) -> DataFileRecord:
    return DataFileRecord(
        path=f"dt=1/f{n}.parquet", partition="dt=1", file_group="0", rows=rows, size=1, checksum=f"xxh64:{n:016x}"
    )


def uuid_keys(n: int, seed: int = 0) -> pa.Array:
    rng = np.random.default_rng(seed)
    return pa.array([uuid.UUID(bytes=rng.bytes(16)).hex for _ in range(n)], pa.string())


def test_a_saved_index_maps_back_equal_and_finds_the_same_rows(tmp_path: Path) -> None:
    keys = uuid_keys(5000)
    built = FileKeys.of(keys)
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    store.save(record(5000), built)
    path = store.path_of(record(5000))
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    loaded = store.load(record(5000))
    assert loaded is not None
    assert loaded.keys.equals(built.keys)
    assert np.array_equal(loaded.sorted_hashes, built.sorted_hashes) and np.array_equal(loaded.order, built.order)
    probe = Probe.of(pa.concat_arrays([keys.take(pa.array([3, 4000, 17])), uuid_keys(5, seed=9)]))
    hits = GroupKeys.of([("f", "c")], [loaded]).rows_of(probe, {("f", "c"): loaded})
    assert {f: sorted(rows.tolist()) for f, rows in hits.items()} == {("f", "c"): [3, 17, 4000]}


def test_absent_and_disabled(tmp_path: Path) -> None:
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    assert store.load(record(10)) is None  # no directory yet
    off = KeyFiles(tmp_path / "off", 0)
    off.save(record(10), FileKeys.of(uuid_keys(10)))
    assert not (tmp_path / "off").exists()


def _saved(tmp_path: Path, rows: int = 2000) -> tuple[KeyFiles, Path]:
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    store.save(record(rows), FileKeys.of(uuid_keys(rows)))
    return store, store.path_of(record(rows))


@pytest.mark.parametrize("where", [0, 9, 200, -30])
def test_a_flipped_byte_is_refused_deleted_and_logged(
    tmp_path: Path, where: int, caplog: pytest.LogCaptureFixture
) -> None:
    store, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[where] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="dbidx.data.key_files"):
        assert store.load(record(2000)) is None
    assert not path.exists()
    assert "damaged key file" in caplog.text and str(path) in caplog.text


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    store, path = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[:10])
    assert store.load(record(2000)) is None and not path.exists()


def test_a_key_file_under_another_files_name_is_refused(tmp_path: Path) -> None:
    """Same row count, other checksum: the name says one data file, the content indexes another."""
    store, path = _saved(tmp_path)
    other = DataFileRecord(**{**record(2000).__dict__, "checksum": "xxh64:" + "f" * 16})
    os.replace(path, store.path_of(other))
    assert store.load(other) is None
    assert not store.path_of(other).exists()


def _forge(store: KeyFiles, rec: DataFileRecord, index: FileKeys) -> None:
    """A key file with a valid checksum around whatever index it is given (what a bug or a hand could write)."""
    sink = pa.BufferOutputStream()
    key_files._encode(index, rec, sink)
    payload = sink.getvalue()
    store.root.mkdir(parents=True, exist_ok=True)
    store.path_of(rec).write_bytes(
        struct.pack("<8sQ", key_files.MAGIC, xxhash.xxh64(payload).intdigest()) + payload.to_pybytes()
    )


def test_forged_indexes_with_valid_checksums_are_refused(tmp_path: Path) -> None:
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    keys = uuid_keys(3000)
    good = FileKeys.of(keys)
    rec = record(3000)
    # 1. Sorted hashes that are not the keys' hashes: rows would hide from the search.
    _forge(store, rec, FileKeys(keys, np.sort(good.sorted_hashes[::-1] ^ np.uint32(1)), good.order))
    assert store.load(rec) is None
    # 2. Hashes out of order.
    _forge(store, rec, FileKeys(keys, good.sorted_hashes[::-1].copy(), good.order[::-1].copy()))
    assert store.load(rec) is None
    # 3. A row number past the file.
    order = good.order.copy()
    order[5] = 3000
    _forge(store, rec, FileKeys(keys, good.sorted_hashes, order))
    assert store.load(rec) is None
    # 4. Fewer keys than the data file has rows.
    short = FileKeys.of(keys.slice(0, 2999))
    _forge(store, rec, short)
    assert store.load(rec) is None
    # 5. A row listed twice (standing in for one the search would then miss).
    order = good.order.copy()
    order[7] = order[8]
    _forge(store, rec, FileKeys(keys, good.sorted_hashes, order))
    assert store.load(rec) is None
    # 6. String offsets that run backwards or past the data (a reader trusting them crashes), and large strings.
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int32)[:3001].copy()
    for bad in (offsets[10] - 5, offsets[-1] + 10_000_000):
        broken = offsets.copy()
        broken[1500] = bad
        forged = pa.Array.from_buffers(pa.string(), 3000, [None, pa.py_buffer(broken.tobytes()), keys.buffers()[2]])
        _forge(store, rec, FileKeys(forged, good.sorted_hashes, good.order))
        assert store.load(rec) is None and not store.path_of(rec).exists()
    _forge(store, rec, FileKeys(keys.cast(pa.large_string()), good.sorted_hashes, good.order))
    assert store.load(rec) is None
    # 7. The honest one passes.
    _forge(store, rec, good)
    assert store.load(rec) is not None


def test_trim_drops_least_recently_used_past_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    probe = KeyFiles(tmp_path / "probe", 1 << 30)
    probe.save(record(1000), FileKeys.of(uuid_keys(1000)))
    one = probe.path_of(record(1000)).stat().st_size
    roomy = KeyFiles(tmp_path / "keys", 1 << 30)
    for n in range(5):
        roomy.save(record(1000, n), FileKeys.of(uuid_keys(1000, seed=n)))
        path = roomy.path_of(record(1000, n))
        os.utime(path, (time.time() - 100 + n, time.time() - 100 + n))
        sizes.append(path.stat().st_size)
    assert roomy.load(record(1000, 0)) is not None  # used now: the most recent
    store = KeyFiles(tmp_path / "keys", 3 * one + one // 2)  # room for three
    assert store.trim() == 2
    kept = sorted(p.name for p in store.root.iterdir())
    assert kept == sorted(store.path_of(record(1000, n)).name for n in (0, 3, 4))
    # A file-count bound too.
    monkeypatch.setattr(key_files, "MAX_FILES", 1)
    assert store.trim() == 2
    assert [p.name for p in store.root.iterdir()] == [store.path_of(record(1000, 0)).name]


def test_trim_runs_once_per_slice_of_the_budget(tmp_path: Path) -> None:
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    calls = []
    store.trim = lambda: calls.append(1) or 0  # type: ignore[method-assign]
    for n in range(5):
        store.save(record(1000, n), FileKeys.of(uuid_keys(1000, seed=n)))
    assert calls == [1]  # the first save; the next trims once 1/64 of the budget or of MAX_FILES is saved


def test_sweep_removes_unused_files_and_the_empty_directory(tmp_path: Path) -> None:
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    for n in range(3):
        store.save(record(1000, n), FileKeys.of(uuid_keys(1000, seed=n)))
    old = time.time() - 7200
    for n in (0, 1):
        os.utime(store.path_of(record(1000, n)), (old, old))
    stranger, lookalike = store.root / "notes.txt", store.root / "backup.keys"
    for foreign in (stranger, lookalike):
        foreign.write_text("not ours")
        os.utime(foreign, (old, old))
    removed = sweep_unused(store.root, time.time() - 3600)
    assert sorted(removed) == sorted(str(store.path_of(record(1000, n))) for n in (0, 1))
    assert stranger.exists() and lookalike.exists() and store.path_of(record(1000, 2)).exists()
    stranger.unlink()
    lookalike.unlink()
    sweep_unused(store.root, time.time() + 1)
    assert not store.root.exists()
    assert sweep_unused(tmp_path / "never", time.time()) == []


def test_key_columns_map_what_another_process_built(tmp_path: Path) -> None:
    """A fresh process (a new KeyColumns) maps the key file instead of reading the data file; without one it reads,
    and keeps what it built for the next process."""
    keys = uuid_keys(4000)
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    writer = KeyColumns(1 << 30)
    writer.put(record(4000), keys, store)

    def unreadable(_rec: DataFileRecord) -> pa.Array:
        raise AssertionError("the data file was read although its key file is there")

    sources = KeySources()
    reader = KeyColumns(1 << 30)
    found = reader.get(record(4000), unreadable, store, sources)
    assert found.keys.equals(keys) and (sources.memory, sources.key_files, sources.data_files) == (0, 1, 0)
    # A memory hit marks its key file used (in a process that has not touched it in the last TOUCH_EVERY_S; one that
    # has leaves it: the LRU order and a TTL of hours need no more than one syscall per file and minute).
    os.utime(store.path_of(record(4000)), (0, 0))
    assert reader.get(record(4000), unreadable, store, sources) is found
    assert store.path_of(record(4000)).stat().st_mtime == 0  # touched by the load just before
    other_process = KeyFiles(tmp_path / "keys", 1 << 30)
    assert reader.get(record(4000), unreadable, other_process, sources) is found
    assert sources.memory == 2
    assert store.path_of(record(4000)).stat().st_mtime > time.time() - 60
    # No key file: the data file is read, and its index kept for the next process.
    third = KeyColumns(1 << 30)
    third.get(record(4000, 7), lambda _r: keys, store, sources)
    assert sources.data_files == 1 and store.path_of(record(4000, 7)).exists()


def test_background_saves_land_and_failures_only_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = KeyFiles(tmp_path / "keys", 1 << 30, background=True)
    store.save(record(1000), FileKeys.of(uuid_keys(1000)))
    key_files.wait_for_saves()
    assert store.load(record(1000)) is not None

    def disk_full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    encode = key_files._encode
    monkeypatch.setattr(key_files, "_encode", disk_full)
    with caplog.at_level(logging.WARNING, logger="dbidx.data.key_files"):
        store.save(record(1000, 1), FileKeys.of(uuid_keys(1000)))
        key_files.wait_for_saves()
    assert "could not keep the key index" in caplog.text and "No space left" in caplog.text
    assert [p.name for p in store.root.iterdir()] == [store.path_of(record(1000)).name]  # no temporary file left
    assert store._queued == 0
    # Past MAX_QUEUED_BYTES waiting, a save is skipped (said once) rather than held in memory; one always goes.
    monkeypatch.setattr(key_files, "_encode", encode)
    monkeypatch.setattr(key_files, "MAX_QUEUED_BYTES", 1)
    gate = threading.Event()
    key_files._saver().submit(gate.wait, 10)  # the saver thread busy: saves wait in its queue
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dbidx.data.key_files"):
        for n in (2, 3, 4):
            store.save(record(1000, n), FileKeys.of(uuid_keys(1000)))
        gate.set()
        key_files.wait_for_saves()
    assert [store.path_of(record(1000, n)).exists() for n in (2, 3, 4)] == [True, False, False]
    assert caplog.text.count("skips key files") == 1 and store._queued == 0


def test_the_directory_is_made_private_and_never_again_once_removed(tmp_path: Path) -> None:
    old_mask = os.umask(0o002)
    try:
        table_dir = tmp_path / "table"
        table_dir.mkdir(mode=0o700)
        store = KeyFiles(table_dir / "keys", 1 << 30)
        store.save(record(1000), FileKeys.of(uuid_keys(1000)))
        assert (store.root.stat().st_mode & 0o777) == 0o700
        # The table directory reaped meanwhile: nothing is saved (no directory made anew by the umask).
        sweep_unused(store.root, time.time() + 1)
        table_dir.rmdir()
        store.save(record(1000, 1), FileKeys.of(uuid_keys(1000)))
        assert not table_dir.exists()
    finally:
        os.umask(old_mask)


def test_a_symlinked_directory_is_neither_swept_nor_written(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / f"{'0' * 16}-3.keys"
    victim.write_text("someone else's")
    os.utime(victim, (0, 0))
    (tmp_path / "table").mkdir()
    (tmp_path / "table" / "keys").symlink_to(elsewhere)
    assert sweep_unused(tmp_path / "table" / "keys", time.time()) == [] and victim.exists()
    KeyFiles(tmp_path / "table" / "keys", 1 << 30).save(record(1000, 5), FileKeys.of(uuid_keys(1000)))
    assert sorted(p.name for p in elsewhere.iterdir()) == [victim.name]


def test_only_regular_files_with_our_names_are_read_or_deleted(tmp_path: Path) -> None:
    store = KeyFiles(tmp_path / "keys", 1 << 30)
    store.root.mkdir()
    os.mkfifo(store.path_of(record(1000)))  # opening it would block the batch
    assert store.load(record(1000)) is None
    newline = store.root / f"{'0' * 16}-5.keys\n"
    newline.write_text("a name that only looks like ours")
    os.utime(newline, (0, 0))
    sweep_unused(store.root, time.time())
    assert newline.exists()
