"""The one key normalizer: every public entry that takes record keys (the writer, lookups, the cache, the Spark
driver) turns them into an Arrow string array here, with the same rules everywhere.

Rules: keys come as a list (or any iterable) of `str`, or an Arrow `string` / `large_string` array. A bare `str` or
`bytes` where keys are expected is refused (iterating it would silently make one key per character); so are
non-string elements (bytes, numbers, NaN, None), strings that are not valid UTF-8 (lone surrogates), nulls and empty
keys. The error names the first bad key and its position. Why so strict: a key that is silently converted (bytes to
text, 1 to "1", NaN to "nan") can look up or overwrite another record.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.errors import InvalidKeyError

_SCALARS = (str, bytes, bytearray, memoryview)


def normalize_keys(keys: Any, what: str = "key") -> pa.Array:
    """Validate record keys and return them as one Arrow string array (raises InvalidKeyError)."""
    # 1. A single string or bytes value where a collection is expected.
    if isinstance(keys, _SCALARS):
        raise InvalidKeyError(
            f"{what}s must be a list of keys, got a single {type(keys).__name__} {keys!r:.80}; "
            f"pass a list, e.g. [{keys!r:.40}]"
        )
    # 2. Arrow input: a string type, no nulls, no empty values.
    if isinstance(keys, pa.ChunkedArray):
        keys = one_chunk(keys)
    if isinstance(keys, pa.Array):
        if pa.types.is_large_string(keys.type):
            keys = keys.cast(pa.string())
        if not pa.types.is_string(keys.type):
            raise InvalidKeyError(
                f"{what}s must be strings, got an Arrow array of type {keys.type}; cast the "
                "column to string first if its values are meant as text"
            )
        return _check_values(keys, what)
    # 3. Python (or numpy) collections: every element must be a str that encodes as UTF-8.
    if isinstance(keys, np.ndarray) and keys.dtype.kind not in "OU":
        raise InvalidKeyError(f"{what}s must be strings, got a numpy array of dtype {keys.dtype}")
    try:
        values = list(keys)
    except TypeError as exc:
        raise InvalidKeyError(f"{what}s must be a list of strings, got {type(keys).__name__}") from exc
    if set(map(type, values)) != {str} and values:  # the fast check; find the culprit only on failure
        for i, key in enumerate(values):
            if not isinstance(key, str):
                raise InvalidKeyError(f"{what} at position {i} is {_describe(key)}, not a string")
    try:
        array = pa.array(values, pa.string())
    except (UnicodeEncodeError, pa.ArrowException):
        for i, key in enumerate(values):
            try:
                key.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidKeyError(
                    f"{what} at position {i} ({key!r:.80}) is not valid UTF-8 text: {exc.reason}"
                ) from exc
        raise
    return _check_values(array, what)


def _check_values(array: pa.Array, what: str) -> pa.Array:
    if array.null_count:
        raise InvalidKeyError(f"{what} at position {pc.index(pc.is_null(array), True).as_py()} is null")
    if len(array):
        empty = pc.equal(pc.binary_length(array), 0)
        if pc.any(empty).as_py():
            raise InvalidKeyError(
                f"{what} at position {pc.index(empty, True).as_py()} is empty; every record needs a non-empty key"
            )
    return array


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, float) and value != value:
        return "NaN"
    return f"of type {type(value).__name__} ({value!r:.60})"


# ---- key columns --------------------------------------------------------------------------------------------
# Kinds of column type that are no record key: why each is refused, and the way out (every message names both).
_UNFIT_KEYS = {
    "floating": 'a floating-point key is not exact (1.0 would become the key "1", NaN the key "nan", and two '
    "floats that print alike would be one record); cast it to an integer, decimal or string column first",
    "boolean": 'a boolean key holds two records at most (every row would be record "true" or "false"); key the '
    "table by a column that identifies each record (integer, decimal, date or string)",
    "nested": "a list, struct or map key has no exact text form; key the table by one integer, decimal, date or "
    "string column (for a composite key, join its fields into one string column first)",
}


def unfit_key_kind(arrow_type: pa.DataType) -> str | None:
    """The kind ("floating", "boolean", "nested") of an Arrow type that cannot be a record key, else None."""
    if pa.types.is_floating(arrow_type):
        return "floating"
    if pa.types.is_boolean(arrow_type):
        return "boolean"
    if pa.types.is_nested(arrow_type):
        return "nested"
    return None


def unfit_key_message(column: str, type_name: str, kind: str, where: str) -> str:
    """What, where and how to fix, for a key column of an unfit type (`kind` from unfit_key_kind)."""
    return f"key column {column!r} of {where} is {type_name}: {_UNFIT_KEYS[kind]}"
