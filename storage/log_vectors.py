"""Deletion vectors the Delta log lags behind: files whose vector in the index is not the one the log has.

Why they exist: an absorb of another engine's stale rewrite (table/absorb_stale.py) masks the rows its new files
copied from files that were no longer live. The index (and dbidx's reads) drop them at once; the log, whose version
is that engine's and immutable, gets them in the next Delta version dbidx writes (data/delta_derive.py
`_log_catch_up`). Until then a Delta `remove` of such a file must carry the log's descriptor, not the index's, or
Delta readers would keep the file's old entry live beside the new one.
"""

from __future__ import annotations

from typing import Any

from dbidx.errors import CorruptFileError
from dbidx.storage.records import FieldError, parse_dv_descriptor, parse_path

# An absorb record's extra: {data file: the Delta deletion vector descriptor the log has for it (None: none)}.
LOG_VECTORS_EXTRA = "log_vectors"


def parse_log_vectors(value: Any, where: str) -> dict[str, dict[str, Any] | None]:
    """LOG_VECTORS_EXTRA read back (untrusted): data file -> a Delta DV descriptor or None."""
    if not isinstance(value, dict):
        raise CorruptFileError(f"{where}: {LOG_VECTORS_EXTRA} is not an object")
    out: dict[str, dict[str, Any] | None] = {}
    for path, descriptor in sorted(value.items()):
        name = f"{where}: {LOG_VECTORS_EXTRA}[{path!r}]"
        try:
            parsed = parse_path(path, name)
            if descriptor is None:
                out[parsed] = None
                continue
            cardinality = descriptor.get("cardinality") if isinstance(descriptor, dict) else None
            if not isinstance(cardinality, int):
                raise FieldError(f"{name}.cardinality is not a whole number")
            out[parsed] = parse_dv_descriptor(descriptor, name, cardinality)
        except (FieldError, ValueError, TypeError) as exc:
            raise CorruptFileError(f"{name} is not valid: {exc}") from exc
    return out
