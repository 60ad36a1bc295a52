"""A Delta checkpoint dbidx publishes never changes (issue 63): delta-rs writes it into a private copy of the log,
dbidx slims it there and puts it if absent, and moves `_last_checkpoint` forward only. Real tables written by
`upsert_arrow` with the services after each upsert, delta-rs and polars loading the table meanwhile in another
process; a thread watching `_delta_log/` records every checkpoint as it first appears."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from deltalake import DeltaTable

from dbidx.config import CacheConfig
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_log import DELTA_LOG_DIR, read_checkpoint_pointer
from dbidx.data.delta_scratch import LogTail, log_tail
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree


def churn(table: Table, cache: Path, i: int, rows: dict[str, int]) -> None:
    """Batch i: updates of keys earlier batches wrote (new vectors for their files: tombstones to slim) and new ones."""
    batch = {f"k{j}": i * 1000 + j for j in range(i % 9 * 20, i % 9 * 20 + 200)}
    upsert_arrow(
        pa.table({"id": list(batch), "dt": ["x" if int(k[1:]) % 2 else "y" for k in batch], "v": list(batch.values())}),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(cache)),
    )
    rows.update(batch)


def expected(rows: dict[str, int]) -> set[tuple]:
    return {(k, "x" if int(k[1:]) % 2 else "y", v) for k, v in rows.items()}


def identity(path: Path) -> tuple[int, int, int, str]:
    """What must never change about a published file: inode, size, modification time and content."""
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, xxhash.xxh64(path.read_bytes()).hexdigest()


class LogWatch(threading.Thread):
    """Lists `_delta_log/` in a loop: each checkpoint as it first appears, and every later sight of it that differs
    (a file rewritten in place, or replaced under its name); every `_last_checkpoint` that names a version below
    one it named before, or a checkpoint whose size is not its `sizeInBytes`."""

    def __init__(self, log: Path) -> None:
        super().__init__(daemon=True)
        self.log = log
        self.first: dict[str, tuple[int, int, int, str]] = {}
        self.changed: dict[str, str] = {}  # name -> its first change
        self.pointers: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        newest = -1
        while True:
            # One last pass that starts after `stop` (set once every write is done), so the newest checkpoint is seen.
            stopping = self.stop.is_set()
            for name in sorted(os.listdir(self.log)):
                path = self.log / name
                try:
                    if name.endswith(".checkpoint.parquet"):
                        seen = identity(path)
                        first = self.first.setdefault(name, seen)
                        if seen != first:
                            self.changed.setdefault(name, f"{first} then {seen}")
                    elif name == "_last_checkpoint":
                        pointer = json.loads(path.read_bytes())
                        named = self.log / f"{pointer['version']:020d}.checkpoint.parquet"
                        if pointer["version"] < newest or pointer["sizeInBytes"] != named.stat().st_size:
                            self.pointers.append(f"{pointer} after version {newest}: {named.stat().st_size} bytes")
                        newest = max(newest, pointer["version"])
                except FileNotFoundError:
                    pass  # a log cleanup deleted it meanwhile: deleting is fine, rewriting is not
            if stopping:
                return
            time.sleep(0.001)


@pytest.mark.slow
def test_no_published_checkpoint_changes_while_dbidx_writes_and_its_services_run(
    tmp_path: Path, services_on: None
) -> None:
    # Delta checkpoints by both paths: the publisher's every 2 completions and the log cleanup service's every
    # version; a second-long log retention, so the service also deletes old checkpoints meanwhile.
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=2)
    table.configure_services(vacuum=False, clean=False)
    rows: dict[str, int] = {}
    churn(table, tmp_path / "cache", 0, rows)
    table.set_delta_properties({"delta.checkpointInterval": "1", "delta.logRetentionDuration": "interval 1 seconds"})
    log = Path(table.io.path(DELTA_LOG_DIR))
    watch = LogWatch(log)
    watch.start()
    try:
        for i in range(1, 30):
            churn(table, tmp_path / "cache", i, rows)
    finally:
        watch.stop.set()
        watch.join()
    assert len(watch.first) >= 20  # a checkpoint for (nearly) every version, each seen
    assert watch.changed == {}
    assert watch.pointers == []
    left = [name for name in os.listdir(log) if name.endswith(".checkpoint.parquet")]
    assert len(left) < len(watch.first)  # the log cleanup deleted old ones meanwhile
    for name in left:  # and at the end: every checkpoint still there is the one first seen
        assert identity(log / name) == watch.first[name], name
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))


def test_a_checkpoint_of_a_version_that_has_one_is_left_as_it_is(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    rows: dict[str, int] = {}
    for i in range(4):
        churn(table, tmp_path / "cache", i, rows)
    log = Path(table.io.path(DELTA_LOG_DIR))
    first = write_delta_checkpoint(table.io)
    assert first is not None and first.tombstones_dropped > 0
    pointer_before = (log / "_last_checkpoint").read_bytes()
    # Another dbidx process found the same version due: the published checkpoint stays as it is.
    name = log / f"{first.version:020d}.checkpoint.parquet"
    before = identity(name)
    again = write_delta_checkpoint(table.io)
    assert identity(name) == before
    assert (log / "_last_checkpoint").read_bytes() == pointer_before
    # Another engine (delta-rs itself) checkpointed the next version and died before moving the pointer: dbidx
    # leaves that checkpoint as it is and moves the pointer to it.
    churn(table, tmp_path / "cache", 4, rows)
    DeltaTable(table.io.path("")).create_checkpoint()
    (log / "_last_checkpoint").write_bytes(pointer_before)
    theirs = log / f"{table.delta_version():020d}.checkpoint.parquet"
    before = identity(theirs)
    found = write_delta_checkpoint(table.io)
    assert identity(theirs) == before
    pointer = read_checkpoint_pointer(table.io)
    assert pointer["version"] == found.version and pointer["sizeInBytes"] == theirs.stat().st_size
    assert pointer["size"] == pq.ParquetFile(theirs).metadata.num_rows
    assert again is not None and (again.version, again.published) == (first.version, False)
    assert found is not None and (found.version, found.published) == (table.delta_version(), False)
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))


def test_the_pointer_only_moves_forward(tmp_path: Path) -> None:
    from dbidx.data.delta_checkpoint import _move_pointer

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    rows: dict[str, int] = {}
    churn(table, tmp_path / "cache", 0, rows)
    written = write_delta_checkpoint(table.io)
    assert written is not None
    log_pointer = Path(table.io.path(f"{DELTA_LOG_DIR}/_last_checkpoint"))
    newest = log_pointer.read_bytes()
    _move_pointer(table.io, {"version": written.version - 1, "size": 1, "sizeInBytes": 1})  # a slower writer's
    assert log_pointer.read_bytes() == newest
    log_pointer.write_text('{"version": "five"}')  # damaged: a hint lost, replaced
    _move_pointer(table.io, json.loads(newest))
    assert log_pointer.read_bytes() == json.dumps(json.loads(newest), separators=(",", ":")).encode()


READER = """
import json, os, sys
import polars as pl
from deltalake import DeltaTable

path, stop, out = sys.argv[1:4]
loads, errors = 0, []
while not os.path.exists(stop):
    for how in ("deltalake", "polars"):
        try:
            if how == "deltalake":
                DeltaTable(path).file_uris()
            else:
                frame = pl.read_delta(path)
                if frame["id"].n_unique() != frame.height:
                    errors.append(f"polars read a key twice ({frame.height} rows)")
        except Exception as exc:
            errors.append(f"{how}: {type(exc).__name__}: {exc}"[:400])
        loads += 1
with open(out, "w") as f:
    json.dump({"loads": loads, "errors": errors}, f)
"""


@pytest.mark.slow
def test_delta_readers_load_the_table_while_dbidx_writes_and_checkpoints(tmp_path: Path, services_on: None) -> None:
    """Before issue 63's fix, 3% of these loads failed ("Requested range was invalid", Parquet decoding errors): the
    checkpoint they opened was replaced by its slim version between two reads."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=2)
    table.configure_services(vacuum=False, clean=False)  # files deleted under a reader are another matter
    rows: dict[str, int] = {}
    churn(table, tmp_path / "cache", 0, rows)
    table.set_delta_properties({"delta.checkpointInterval": "1"})
    stop, out = tmp_path / "stop", tmp_path / "loads.json"
    reader = subprocess.Popen([sys.executable, "-c", READER, table.io.path(""), str(stop), str(out)])
    try:
        for i in range(1, 40):
            churn(table, tmp_path / "cache", i, rows)
    finally:
        stop.touch()
        reader.wait(timeout=120)
    result = json.loads(out.read_text())
    assert result["loads"] >= 40, result
    assert result["errors"] == [], f"{len(result['errors'])} of {result['loads']} loads failed: {result['errors'][:5]}"
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))


def test_the_log_tail_starts_from_the_newest_checkpoint_the_log_has(tmp_path: Path) -> None:
    """delta-rs gets the newest checkpoint (classic or multi-part, found from the pointer or by a listing) and the
    JSON versions after it; a version missing after it is refused before anything is written."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    rows: dict[str, int] = {}
    for i in range(3):
        churn(table, tmp_path / "cache", i, rows)
    first = write_delta_checkpoint(table.io)
    assert first is not None
    for i in range(3, 5):
        churn(table, tmp_path / "cache", i, rows)
    log = Path(table.io.path(DELTA_LOG_DIR))
    expected_names = (
        f"{first.version:020d}.checkpoint.parquet",
        f"{first.version + 1:020d}.json",
        f"{first.version + 2:020d}.json",
    )
    assert log_tail(table.io) == LogTail(first.version + 2, first.version, expected_names)
    pointer = (log / "_last_checkpoint").read_bytes()
    (log / "_last_checkpoint").unlink()  # no pointer: the listing finds the same
    assert log_tail(table.io) == LogTail(first.version + 2, first.version, expected_names)
    (log / "_last_checkpoint").write_bytes(pointer)
    # Another engine's two-part checkpoint of the latest version, then one more version.
    DeltaTable(table.io.path("")).create_checkpoint()
    latest = table.delta_version()
    whole = pq.read_table(log / f"{latest:020d}.checkpoint.parquet")
    (log / f"{latest:020d}.checkpoint.parquet").unlink()
    half = whole.num_rows // 2
    parts = [f"{latest:020d}.checkpoint.{p:010d}.0000000002.parquet" for p in (1, 2)]
    pq.write_table(whole.slice(0, half), log / parts[0])
    pq.write_table(whole.slice(half), log / parts[1])
    (log / "_last_checkpoint").write_text(json.dumps({"version": latest, "size": whole.num_rows, "parts": 2}))
    churn(table, tmp_path / "cache", 5, rows)
    assert log_tail(table.io) == LogTail(latest + 1, latest, (*parts, f"{latest + 1:020d}.json"))
    written = write_delta_checkpoint(table.io)
    assert written is not None and (written.version, written.published) == (latest + 1, True)
    assert read_checkpoint_pointer(table.io)["version"] == latest + 1
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))
    # A version missing after the newest checkpoint: no reader can load the latest one, and nothing is written.
    churn(table, tmp_path / "cache", 6, rows)
    churn(table, tmp_path / "cache", 7, rows)
    (log / f"{latest + 2:020d}.json").unlink()
    (log / "_last_checkpoint").unlink()
    names = sorted(os.listdir(log))
    with pytest.raises(CorruptFileError, match=rf"misses version\(s\) \[{latest + 2}\] after its newest checkpoint"):
        write_delta_checkpoint(table.io)
    assert sorted(os.listdir(log)) == names
