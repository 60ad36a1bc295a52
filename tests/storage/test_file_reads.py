"""FileIO's whole-file reads: checked bytes, in memory Arrow owns (Parquet readers decode them on Arrow's threads)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import READ_CHUNK, FileIO, file_checksum


def _parquet_bytes(rows: int) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"key": [f"k{i:09d}" for i in range(rows)]}), sink)
    return sink.getvalue()


def _arrow_allocates(read) -> pa.Buffer:  # type: ignore[no-untyped-def]
    """Run a read; assert the buffer it returns was allocated by Arrow's memory pool, not wrapped from `bytes`."""
    before = pa.total_allocated_bytes()
    data = read()
    assert pa.total_allocated_bytes() - before >= data.size > 0
    return data


def test_verified_and_plain_reads_return_arrow_memory(tmp_path: Path) -> None:
    io = FileIO.from_uri(str(tmp_path))
    data = _parquet_bytes(50_000)
    io.write_atomic("a.parquet", data)
    verified = _arrow_allocates(lambda: io.read_verified("a.parquet", data.size, file_checksum(data)))
    plain = _arrow_allocates(lambda: io.read_buffer("a.parquet"))
    assert verified.equals(data) and plain.equals(data)
    assert io.read_bytes("a.parquet") == data.to_pybytes()


def test_a_file_larger_than_one_chunk_is_read_whole(tmp_path: Path) -> None:
    io = FileIO.from_uri(str(tmp_path))
    data = pa.py_buffer(bytes(range(256)) * (READ_CHUNK // 256 * 2 + 3))
    io.write_atomic("big.bin", data)
    assert _arrow_allocates(lambda: io.read_buffer("big.bin")).equals(data)
    assert io.read_verified("big.bin", data.size, file_checksum(data)).equals(data)


def test_an_empty_file_reads_as_an_empty_buffer(tmp_path: Path) -> None:
    io = FileIO.from_uri(str(tmp_path))
    io.write_atomic("empty.bin", b"")
    assert io.read_buffer("empty.bin").size == 0
    assert io.read_verified("empty.bin", 0, file_checksum(b"")).size == 0


@pytest.mark.parametrize("change", ["truncated", "grown"])
def test_a_verified_read_refuses_a_file_of_another_size(tmp_path: Path, change: str) -> None:
    io = FileIO.from_uri(str(tmp_path))
    data = _parquet_bytes(1_000)
    on_disk = data.to_pybytes()[:-1] if change == "truncated" else data.to_pybytes() + b"x"
    io.write_atomic("a.parquet", on_disk)
    with pytest.raises(CorruptFileError, match=rf"a\.parquet has {len(on_disk)} bytes but its commit recorded"):
        io.read_verified("a.parquet", data.size, file_checksum(data))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    io = FileIO.from_uri(str(tmp_path))
    with pytest.raises(CorruptFileError, match=r"nope\.parquet is missing"):
        io.read_buffer("nope.parquet")
