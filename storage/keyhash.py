"""The key hash: exactly Spark SQL's `hash()` of a string (Murmur3 x86_32, seed 42, Spark's tail handling).

Why this hash: it is stable across processes, Python versions and machines (Python's own `hash()` is salted per
process), and it equals what Spark computes, so `df.repartition(num_shards, col(key).cast("string"))` places every
row on the Spark partition whose id is the key's shard, with no Python UDF and no extra shuffle. Spark's variant
differs from standard Murmur3 (and the `mmh3` package) on the last len % 4 bytes: each tail byte is mixed on its
own as a sign-extended 32-bit word.

The vectorized path works on the Arrow string buffers with numpy: one pass per 4-byte word position across all
keys at once, so the cost is ~ (max key length / 4) numpy passes per batch, not a Python call per key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dbidx.arrays import offsets_and_data, one_chunk
from dbidx.errors import InvalidInputError, InvalidKeyError

HASH_NAME = "spark-murmur3-x86_32-seed42"
SEED = 42
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_MASK = 0xFFFFFFFF
_CHUNK = 1 << 20


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix_k1(k1: int) -> int:
    return (_rotl((k1 * _C1) & _MASK, 15) * _C2) & _MASK


def _mix_h1(h1: int, k1: int) -> int:
    return (_rotl(h1 ^ k1, 13) * 5 + 0xE6546B64) & _MASK


def _fmix(h1: int, length: int) -> int:
    h1 ^= length
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK
    return h1 ^ (h1 >> 16)


def spark_hash_one(key: str) -> int:
    """Spark's `hash(key)` for one string, as a signed int32 (the reference the vectorized path is tested against)."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"a record key must be a string, got {type(key).__name__}: {key!r:.40}")
    data = key.encode("utf-8")
    aligned = len(data) - len(data) % 4
    h1 = SEED
    for i in range(0, aligned, 4):
        h1 = _mix_h1(h1, _mix_k1(int.from_bytes(data[i : i + 4], "little")))
    for b in data[aligned:]:
        h1 = _mix_h1(h1, _mix_k1((b - 256 if b > 127 else b) & _MASK))
    h = _fmix(h1, len(data))
    return h - (1 << 32) if h & 0x80000000 else h


def _to_string_array(keys: Any) -> pa.Array:
    """Accept str lists, Arrow (large_)string arrays and chunked arrays; reject nulls."""
    if isinstance(keys, (str, bytes)):
        raise InvalidInputError(f"pass a list or array of record keys, not one {type(keys).__name__} ({keys!r:.40})")
    if isinstance(keys, pa.ChunkedArray):
        keys = one_chunk(keys)
    if not isinstance(keys, pa.Array):
        keys = list(keys)
        bad = next((k for k in keys if k is not None and not isinstance(k, str)), None)
        if bad is not None:
            raise InvalidKeyError(f"record keys must be strings, got {type(bad).__name__}: {bad!r:.40}")
        keys = pa.array(keys, pa.string())
    if not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)):
        raise InvalidKeyError(f"record keys must be strings, got Arrow type {keys.type}")
    if keys.null_count:
        raise InvalidKeyError("a record key is null; nulls are not valid record keys")
    return keys


def _hash_chunk(keys: pa.Array) -> np.ndarray:
    """Vectorized Spark Murmur3 over one Arrow string array (no nulls)."""
    n = len(keys)
    # Only this chunk's bytes (a slice of a larger array shares the whole data buffer), offsets rebased onto them.
    offsets, raw = offsets_and_data(keys)
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    aligned = lengths - lengths % 4
    h1 = np.full(n, SEED, dtype=np.uint32)
    c1, c2 = np.uint32(_C1), np.uint32(_C2)
    spare = np.empty(n, dtype=np.uint32)  # reused by every mix of the uniform path: no temporaries per word

    def mix(h: np.ndarray, k: np.ndarray) -> np.ndarray:
        k = k * c1
        k = (k << np.uint32(15)) | (k >> np.uint32(17))
        k = k * c2
        h = h ^ k
        h = (h << np.uint32(13)) | (h >> np.uint32(19))
        return h * np.uint32(5) + np.uint32(0xE6546B64)

    def mix_in_place(h: np.ndarray, word: np.ndarray) -> None:
        """mix(h, word) into h, with `spare` and one scratch array."""
        k = np.multiply(word, c1)
        np.right_shift(k, np.uint32(17), out=spare)
        k <<= np.uint32(15)
        k |= spare
        k *= c2
        h ^= k
        np.right_shift(h, np.uint32(19), out=spare)
        h <<= np.uint32(13)
        h |= spare
        h *= np.uint32(5)
        h += np.uint32(0xE6546B64)

    with np.errstate(over="ignore"):
        # 1. Aligned 4-byte little-endian words, one word position at a time across all keys still that long. Keys
        #    of one length (UUIDs, fixed-width ids) are one contiguous block: its words are a 2-D view, no gathers.
        max_words = int(aligned.max() // 4) if n else 0
        uniform = n > 0 and bool(lengths.min() == lengths.max())
        if uniform and max_words:
            block = raw.reshape(n, int(lengths[0]))
            words = np.ascontiguousarray(block[:, : 4 * max_words].view("<u4").T)  # word positions as rows
            for w in range(max_words):
                mix_in_place(h1, words[w])
        if not uniform:
            raw = np.concatenate([raw, np.zeros(4, np.uint8)])  # reads past the end of the last key stay in bounds
        data = raw
        for w in range(0 if uniform else max_words):
            active = np.nonzero(aligned > 4 * w)[0]
            pos = starts[active] + 4 * w
            word = (
                data[pos].astype(np.uint32)
                | (data[pos + 1].astype(np.uint32) << np.uint32(8))
                | (data[pos + 2].astype(np.uint32) << np.uint32(16))
                | (data[pos + 3].astype(np.uint32) << np.uint32(24))
            )
            h1[active] = mix(h1[active], word)
        # 2. Up to three tail bytes, each mixed alone as a sign-extended byte (Spark's quirk).
        for t in range(3):
            active = np.nonzero(lengths - aligned > t)[0]
            if len(active) == 0:
                break
            byte = data[starts[active] + aligned[active] + t].astype(np.int8).astype(np.int32).astype(np.uint32)
            h1[active] = mix(h1[active], byte)
        # 3. Finalization.
        h1 ^= lengths.astype(np.uint32)
        h1 ^= h1 >> np.uint32(16)
        h1 *= np.uint32(0x85EBCA6B)
        h1 ^= h1 >> np.uint32(13)
        h1 *= np.uint32(0xC2B2AE35)
        h1 ^= h1 >> np.uint32(16)
    return h1.view(np.int32)


def spark_hash(keys: Any) -> np.ndarray:
    """Spark's `hash()` of every key, as an int32 numpy array (chunks of 1 M keys bound the temporaries)."""
    array = _to_string_array(keys)
    if len(array) <= _CHUNK:
        return _hash_chunk(array)
    return np.concatenate([_hash_chunk(array.slice(i, _CHUNK)) for i in range(0, len(array), _CHUNK)])


def shard_of(keys: Any, num_shards: int) -> np.ndarray:
    """`pmod(hash(key), num_shards)` per key: the shard (and Spark partition after repartition) of each key."""
    return shards_of_hashes(spark_hash(keys), num_shards)


def shards_of_hashes(hashes: np.ndarray, num_shards: int) -> np.ndarray:
    """`shard_of` from the keys' `spark_hash` values, for a caller that needs the hashes for something else too."""
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise InvalidInputError(f"num_shards must be a positive integer, got {num_shards!r}")
    return np.mod(hashes.astype(np.int64), int(num_shards)).astype(np.int32)


def shard_of_one(key: str, num_shards: int) -> int:
    """The shard of a single key."""
    if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool) or num_shards < 1:
        raise InvalidInputError(f"num_shards must be a positive integer, got {num_shards!r}")
    return spark_hash_one(key) % num_shards
