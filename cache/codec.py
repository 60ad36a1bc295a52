"""Byte encodings of the cache: record keys and locations, chosen for on-disk size (measured in cache_bench.py).

Keys: a one-byte tag then a compact body, per key, so one partition may mix key shapes:
  0x01 + 16 bytes      canonical lower-case UUID strings (36 chars -> 17 bytes)
  0x20+L + 5 + 5 bytes decimal digit strings of length L (1..20, leading zeros kept): high and low 10 digits, each
                       as a 5-byte big-endian integer; order-preserving, so sequential ids share long prefixes that
                       RocksDB's block prefix encoding stores once
  0x00 + UTF-8         anything else
The encoding is injective (a UUID with upper-case letters or a digit string longer than 20 is stored raw), so
decoding always gives back the exact key. Values: the varint index of the location in the column family's
location dictionary (file group ids, or "partition\\0file group" in global mode): 1 byte for the first 128 file
groups of a partition, 2 bytes up to 16 384.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import offsets_and_data, one_chunk
from dbidx.errors import CacheError, InvalidKeyError

TAG_RAW = 0x00
TAG_UUID = 0x01
TAG_DIGITS = 0x20
_UUID_DASHES = (8, 13, 18, 23)
_UUID_HEX_RUNS = ((0, 8), (9, 13), (14, 18), (19, 23), (24, 36))  # the hex digits between the dashes
_NIBBLES = bytes(int(chr(b), 16) if chr(b) in "0123456789abcdef" else 0xFF for b in range(256))
_ORDER_WINDOW = 40  # lookup_order looks this far into the keys for the first byte that varies
_POW10 = (10 ** np.arange(9, -1, -1, dtype=np.uint64)).astype(np.uint64)


def as_string_array(values: Any) -> pa.Array:
    """One Arrow array from a list of str, an Arrow array or a chunked array; large_string becomes string."""
    if isinstance(values, pa.ChunkedArray):
        values = one_chunk(values)
    if not isinstance(values, pa.Array):
        values = pa.array(list(values), pa.string())
    if pa.types.is_large_string(values.type):
        values = values.cast(pa.string())
    return values


def _string_parts(keys: Any) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
    """(array, starts, lengths, data bytes) of an Arrow string array or a list of str."""
    keys = as_string_array(keys)
    offsets, data = offsets_and_data(keys)
    return keys, offsets[:-1], offsets[1:] - offsets[:-1], data


def _all_uuids(data: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray | None:
    """Encoded bodies (n x 17) when every key is a canonical UUID, else None (the general path decides per key).
    Only for arrays whose every key is 36 bytes long (so the keys are stored back to back).

    Why a second path: batches of UUID keys are the common case, and one bytes.translate (in C) both maps every hex
    digit to its value and deletes the dashes, several times faster than the per-byte numpy arithmetic below. The
    dashes are checked in place first; exactly 32 bytes per key remain only if there was no other dash, and those
    are the hex runs' values in order.
    """
    block = data[int(starts[0]) : int(starts[0]) + 36 * n]
    if not np.all(block.reshape(n, 36)[:, list(_UUID_DASHES)] == ord("-")):
        return None
    nibbles = block.tobytes().translate(_NIBBLES, b"-")  # hex digit -> its value, any other byte -> 0xFF
    if len(nibbles) != 32 * n or b"\xff" in nibbles:  # a stray dash, or a byte that is not a lower-case hex digit
        return None
    pairs = np.frombuffer(nibbles, dtype=np.uint8).reshape(n, 16, 2)
    body = np.empty((n, 17), dtype=np.uint8)
    body[:, 0] = TAG_UUID
    np.left_shift(pairs[:, :, 0], 4, out=body[:, 1:])
    body[:, 1:] |= pairs[:, :, 1]
    return body


def _matrix(data: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """Rows of `width` bytes starting at each start (callers only pass keys at least that long).

    A sliding-window view gathers whole rows, ~10x faster than indexing with a 2-D array of byte offsets.
    """
    if len(data) < width:
        data = np.concatenate([data, np.zeros(width, np.uint8)])
    return np.lib.stride_tricks.sliding_window_view(data, width)[starts]


def encode_keys(keys: Any) -> list[bytes]:
    """Encode record keys (Arrow string array or list of str) to their cache byte form, in input order."""
    return encode_keys_binary(keys).to_pylist()


def encode_keys_binary(keys: Any) -> pa.Array:
    """Encode record keys to an Arrow binary array, fully vectorised (no Python work per key).

    Each key's encoded width is known from its class (UUID 17, digits 11, raw 1 + length), so the output buffer is
    laid out first (offsets = cumulative widths) and each class's bytes are scattered into it with numpy.
    """
    array, starts, lengths, data = _string_parts(keys)
    n = len(array)
    if array.null_count:
        raise InvalidKeyError(f"{array.null_count} record key(s) are null")
    widths = lengths + 1  # raw: tag + UTF-8 bytes, unless a compact class applies below
    bodies: list[tuple[np.ndarray, np.ndarray]] = []
    done = np.zeros(n, dtype=bool)
    # 1. Canonical UUIDs: dashes in place, 32 lower-case hex digits.
    cand = np.nonzero(lengths == 36)[0]
    every = _all_uuids(data, starts, n) if n and len(cand) == n else None
    if every is not None:
        bodies.append((cand, every))
        done[:] = True
        widths[:] = 17
    elif len(cand):
        mat = _matrix(data, starts[cand], 36)
        ok = np.all(mat[:, list(_UUID_DASHES)] == ord("-"), axis=1)
        hexed = np.concatenate([mat[:, a:b] for a, b in _UUID_HEX_RUNS], axis=1)
        # Nibbles in one pass (uint8 arithmetic wraps): '0'-'9' -> c - 48, 'a'-'f' -> c - 87; any other byte
        # gives a value >= 16, except 58..96 (':' to '`'), excluded by range. 32 flags per row = 4 uint64 words.
        nib = hexed - np.uint8(48)
        np.minimum(nib, hexed - np.uint8(87), out=nib)
        bad = (nib >= 16) | ((hexed - np.uint8(58)) < 39)
        ok &= ~bad.view(np.uint64).any(axis=1)
        rows = cand[ok]
        if len(rows):
            nib = nib[ok] if len(rows) < len(cand) else nib
            body = np.empty((len(rows), 17), dtype=np.uint8)
            body[:, 0] = TAG_UUID
            body[:, 1:] = (nib[:, 0::2] << 4) | nib[:, 1::2]
            bodies.append((rows, body))
            done[rows] = True
            widths[rows] = 17
    # 2. Decimal digit strings of length 1..20 (one pass per length present).
    for length in np.unique(lengths[(lengths >= 1) & (lengths <= 20) & ~done]):
        cand = np.nonzero((lengths == length) & ~done)[0]
        mat = _matrix(data, starts[cand], int(length)).astype(np.int16) - ord("0")
        ok = np.all((mat >= 0) & (mat <= 9), axis=1)
        rows = cand[ok]
        if not len(rows):
            continue
        digits = np.zeros((len(rows), 20), dtype=np.uint64)
        digits[:, 20 - int(length) :] = mat[ok]
        hi, lo = digits[:, :10] @ _POW10, digits[:, 10:] @ _POW10
        body = np.empty((len(rows), 11), dtype=np.uint8)
        body[:, 0] = TAG_DIGITS + int(length)
        for j in range(5):
            body[:, 1 + j] = (hi >> np.uint64(8 * (4 - j))) & np.uint64(0xFF)
            body[:, 6 + j] = (lo >> np.uint64(8 * (4 - j))) & np.uint64(0xFF)
        bodies.append((rows, body))
        done[rows] = True
        widths[rows] = 11
    # 3. Lay out the output buffer, then place each class's bytes (one class covering every key, the usual
    #    case, is the buffer as it stands).
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(widths, out=offsets[1:])
    raw_rows = np.nonzero(~done)[0]
    fixed_raw = len(raw_rows) == n > 0 and bool((lengths == lengths[0]).all())
    if len(bodies) == 1 and len(bodies[0][0]) == n:
        out = bodies[0][1].reshape(-1)
    elif fixed_raw:
        # Every key raw and of one length (fixed-width ids, e.g. 32 hex digits): a tag column beside the keys'
        # bytes as rows, instead of per-byte index arrays (64 M of them for 2 M such keys).
        width = int(lengths[0])
        grid = np.empty((n, width + 1), dtype=np.uint8)
        grid[:, 0] = TAG_RAW
        if width:
            grid[:, 1:] = _matrix(data, starts, width)
        out = grid.reshape(-1)
    else:
        out = np.empty(int(offsets[-1]), dtype=np.uint8)
        for rows, body in bodies:
            out[offsets[rows][:, None] + np.arange(body.shape[1])] = body
    if len(raw_rows) and not fixed_raw:
        out[offsets[raw_rows]] = TAG_RAW
        raw_len = lengths[raw_rows]
        total = int(raw_len.sum())
        if total:
            # For every raw byte: its offset within its key, then source (data) and target (out) positions.
            within = np.arange(total) - np.repeat(np.cumsum(raw_len) - raw_len, raw_len)
            target = np.repeat(offsets[raw_rows] + 1, raw_len) + within
            out[target] = data[np.repeat(starts[raw_rows], raw_len) + within]
    if offsets[-1] < 2**31:
        return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(out)])
    return pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(out)])


GLOBAL_SEPARATOR = "\x00"  # between partition and file group in a global-mode location (no partition holds NUL)


def global_location(partition: str, file_group: str) -> str:
    """A global-mode cache value: the key's partition and file group in one string."""
    return f"{partition}{GLOBAL_SEPARATOR}{file_group}"


def split_global_location(location: str) -> tuple[str, str]:
    """Inverse of global_location."""
    partition, _, file_group = location.partition(GLOBAL_SEPARATOR)
    return partition, file_group


def lookup_order(encoded: pa.Array) -> np.ndarray:
    """Positions of encoded keys in (nearly) ascending byte order: by 8 bytes from where the batch's keys first
    differ.

    Why: multi-gets in key order run about twice as fast as in input order (block locality); an exact order is
    not needed for correctness, and sorting a uint64 costs ~1.5 ms per 100 k keys against ~20 ms for Arrow's sort
    of the binary values. Starting at the first byte that varies keeps the order exact for keys that share a
    long prefix (sequential ids share their tag and high digits). Keys shorter than the window read into their
    successors, which only blurs the order among such keys.
    """
    n = len(encoded)
    if not n:
        return np.zeros(0, dtype=np.int64)
    offsets, data = offsets_and_data(encoded)
    heads = _matrix(np.concatenate([data, np.zeros(_ORDER_WINDOW + 8, np.uint8)]), offsets[:-1], _ORDER_WINDOW + 8)
    sample = heads[:: max(1, n // 1024), :_ORDER_WINDOW]  # where keys start to differ, judged on ~1 k of them
    varying = np.flatnonzero((sample != sample[0]).any(axis=0))
    if not len(varying):  # a longer shared prefix (tenant/table/... paths): Arrow's exact sort of the bytes
        return pc.sort_indices(encoded).to_numpy()
    first = int(varying[0])
    prefix = np.ascontiguousarray(heads[:, first : first + 8]).view(">u8").ravel()
    return np.argsort(prefix)


def decode_key(encoded: bytes) -> str:
    """The record key of an encoded cache key; bytes that no encoder produces are a CacheError (the cache is
    damaged), never a wrong key."""
    tag = encoded[0] if encoded else -1
    if tag == TAG_UUID and len(encoded) == 17:
        h = encoded[1:17].hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    if TAG_DIGITS < tag <= TAG_DIGITS + 20 and len(encoded) == 11:
        value = int.from_bytes(encoded[1:6], "big") * 10**10 + int.from_bytes(encoded[6:11], "big")
        text = str(value).zfill(tag - TAG_DIGITS)
        if len(text) == tag - TAG_DIGITS:
            return text
    if tag == TAG_RAW and len(encoded) > 1:
        try:
            return encoded[1:].decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise CacheError(
        f"cache key {bytes(encoded[:40])!r} is not an encoded record key: the cache is damaged, delete it to rebuild"
    )


def encode_index(index: int) -> bytes:
    """Varint (LEB128) of a location index."""
    out = bytearray()
    while True:
        byte = index & 0x7F
        index >>= 7
        if index:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_index(value: bytes) -> int:
    """Inverse of encode_index."""
    result = shift = 0
    for byte in value:
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return result
