"""File group ids of buckets: `<bucket:08d>-<uuid tail>`, stable per (table, partition, bucket).

Why derived and not random: a bucket's file group id must be the same in every task attempt, every executor and
every later batch that opens the bucket, without a registry round trip. A name-based UUID (uuid5) over the table
id, partition and bucket gives exactly that, and two writers that open the same bucket agree on its file group.
"""

from __future__ import annotations

import re
import uuid

from dbidx.errors import InvalidInputError

_NAMESPACE = uuid.UUID("5d0b8d2c-3f4e-4d8a-9b1e-6a1f0c2e7d90")
_BUCKET_FG = re.compile(r"^(\d{8})-[0-9a-f]{24}$")
MAX_BUCKET = 99_999_999


def file_group_id(table_id: str, partition: str, bucket: int) -> str:
    """The file group id of a bucket of a partition: 8-digit bucket id, then 24 hex digits of a stable UUID."""
    if not isinstance(bucket, int) or not 0 <= bucket <= MAX_BUCKET:
        raise InvalidInputError(f"bucket id must be an integer in 0..{MAX_BUCKET}, got {bucket!r}")
    tail = uuid.uuid5(_NAMESPACE, f"{table_id}\x00{partition}\x00{bucket}").hex[8:]
    return f"{bucket:08d}-{tail}"


def bucket_of(file_group: str) -> int | None:
    """The bucket id in a bucket file group id; None for other file groups (e.g. migrated data files)."""
    match = _BUCKET_FG.match(file_group)
    return int(match.group(1)) if match else None
