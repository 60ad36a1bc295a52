"""keyhash: Spark-identical Murmur3 of string keys, scalar and vectorized, stable across processes and Spark."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.errors import DbidxError, InvalidInputError, InvalidKeyError
from dbidx.table.facade import Table
from dbidx.storage.keyhash import HASH_NAME, shard_of, shard_of_one, spark_hash, spark_hash_one

GOLDEN: dict[str, int] = {
    "": 142593372,
    "a": 1485273170,
    "ab": -97053317,
    "abc": 1322437556,
    "abcd": -396302900,
    "abcde": 814637928,
    "é": 2119106806,
    "日本語": -1143049834,
    "😀x": -1814635023,
    "hello world!": -294328854,
}
KEYS = st.lists(st.text(min_size=1, max_size=80), min_size=1, max_size=60)


def test_hash_name() -> None:
    """The hash identity persisted in table properties."""
    assert HASH_NAME == "spark-murmur3-x86_32-seed42"


@pytest.mark.parametrize(("key", "want"), GOLDEN.items())
def test_golden_values_scalar_and_vectorized(key: str, want: int) -> None:
    """Spark's verified `hash()` values; the vectorized path accepts "" (it does not reject empty keys)."""
    assert spark_hash_one(key) == want
    for arr in (pa.array([key]), pa.array([key], pa.large_string())):
        got = spark_hash(arr)
        assert got.dtype == np.int32 and got.tolist() == [want]
    assert spark_hash(list(GOLDEN)).tolist() == list(GOLDEN.values())


@settings(max_examples=200, deadline=None)
@given(KEYS)
def test_vectorized_matches_scalar(keys: list[str]) -> None:
    """Lists, string and large_string arrays all agree with the scalar reference."""
    want = [spark_hash_one(k) for k in keys]
    assert spark_hash(keys).tolist() == want
    assert spark_hash(pa.array(keys, pa.large_string())).tolist() == want


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 23).flatmap(
        lambda n: st.lists(st.text(min_size=n, max_size=n, alphabet="ab0é日"), min_size=1, max_size=40)
    ),
    st.integers(0, 5),
)
def test_keys_of_one_byte_length_take_the_block_path(keys: list[str], skip: int) -> None:
    """Keys of one UTF-8 length (UUIDs, fixed-width ids) are hashed as one 2-D block: same values, sliced too."""
    same = [k for k in keys if len(k.encode()) == len(keys[0].encode())]
    want = [spark_hash_one(k) for k in same]
    assert spark_hash(pa.array(same, pa.string())).tolist() == want
    padded = pa.array(["x" * (skip + 1)] * skip + same, pa.large_string()).slice(skip)
    assert spark_hash(padded).tolist() == want


@settings(max_examples=100, deadline=None)
@given(KEYS, KEYS, st.integers(0, 30), st.integers(0, 30))
def test_sliced_and_chunked_inputs(a: list[str], b: list[str], lo: int, hi: int) -> None:
    """Non-zero array offsets and multi-chunk ChunkedArrays hash like the plain keys."""
    keys = a + b
    lo = min(lo, len(keys))
    hi = max(lo, len(keys) - hi)
    for typ in (pa.string(), pa.large_string()):
        sliced = pa.array(["pad"] * 3 + keys, typ).slice(3 + lo, hi - lo)
        assert spark_hash(sliced).tolist() == [spark_hash_one(k) for k in keys[lo:hi]]
        chunked = pa.chunked_array([pa.array(a, typ), pa.array(keys, typ).slice(len(a))])
        assert spark_hash(chunked).tolist() == [spark_hash_one(k) for k in keys]
    assert spark_hash(pa.chunked_array([pa.array(keys).slice(1)])).tolist() == [spark_hash_one(k) for k in keys[1:]]


def test_empty_inputs() -> None:
    """Zero keys give an empty int32 array."""
    for keys in ([], pa.array([], pa.string()), pa.chunked_array([], pa.large_string())):
        assert spark_hash(keys).dtype == np.int32 and len(spark_hash(keys)) == 0


def test_stable_across_processes() -> None:
    """Another interpreter with a different PYTHONHASHSEED computes the same hashes."""
    keys = list(GOLDEN) + ["key-1", "ñandú", "x" * 77]
    code = (
        "import sys; from dbidx.storage.keyhash import spark_hash, spark_hash_one as h; ks = sys.argv[1:];"
        "print(*[h(k) for k in ks]); print(*spark_hash(ks).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *keys],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        cwd=Path(__file__).parent,
    ).stdout
    scalar, vector = (list(map(int, line.split())) for line in out.splitlines())
    assert scalar == vector == [spark_hash_one(k) for k in keys]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 1000])
def test_shard_is_pmod_of_hash(n: int, tmp_path: Path) -> None:
    """shard = pmod(hash, n) in [0, n), negative hashes included, for every entry point."""
    keys = list(GOLDEN) + [f"k{i}" for i in range(300)]
    want = [((spark_hash_one(k) % n) + n) % n for k in keys]
    assert any(spark_hash_one(k) < 0 for k in keys)
    assert shard_of(keys, n).tolist() == want and shard_of(keys, np.int64(n)).tolist() == want
    assert [shard_of_one(k, n) for k in keys] == want
    assert Table.create(str(tmp_path / "t"), num_shards=n).shard_of(keys).tolist() == want


@pytest.mark.parametrize(
    "bad",
    [
        pa.array(["a", None]),
        ["a", None],
        pa.chunked_array([["a"], [None]]),
        pa.array([1, 2]),
        pa.array([b"a"]),
        pa.array(["a"]).dictionary_encode(),
    ],
)
def test_null_or_non_string_arrow_keys_raise_invalid_key(bad: Any) -> None:
    """Nulls and non-string Arrow types are rejected with InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        spark_hash(bad)


@pytest.mark.parametrize("n", [0, -3, 2.5, "4"])
def test_bad_num_shards(n: Any) -> None:
    """num_shards must be a positive integer."""
    with pytest.raises(InvalidInputError):
        shard_of(["a"], n)


@pytest.mark.parametrize(
    "call",
    [
        lambda: spark_hash([1, 2]),
        lambda: spark_hash("abc"),
        lambda: spark_hash([b"a"]),
        lambda: spark_hash_one(None),
        lambda: shard_of_one("a", 2.5),
    ],
    ids=["int-list", "bare-str", "bytes-list", "none-scalar", "float-shards"],
)
def test_non_string_inputs_raise_dbidx_errors(call: Any) -> None:
    """Python non-str lists, a bare str (would hash its characters), a None scalar, a float shard count."""
    with pytest.raises(DbidxError):
        call()


@pytest.mark.spark
def test_matches_spark_hash_and_repartition(spark: Any) -> None:
    """F.hash equals spark_hash, and repartition(8, k) puts each key on partition shard_of(k, 8)."""
    from pyspark.sql import functions as F

    rng = random.Random(7)
    alphabet = "abcxyzAZ09 -_éñß日本語😀\u0301"
    keys = list(GOLDEN)[1:] + ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(2000)]
    df = spark.createDataFrame([(k,) for k in keys], "k string")
    rows = df.select("k", F.hash("k").alias("h")).collect()
    got = {r.k: r.h for r in rows}
    assert len(rows) == len(keys) and [got[k] for k in keys] == spark_hash(keys).tolist()
    parts = df.repartition(8, "k").select("k", F.spark_partition_id().alias("p")).collect()
    want = dict(zip(keys, shard_of(keys, 8).tolist()))
    assert len(parts) == len(keys) and all(r.p == want[r.k] for r in parts)
