"""dbidx.plain.plain: the same result as dataclasses.asdict, for the records commits carry and for odd values."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import asdict, dataclass, field
from typing import Any

from dbidx.cache.registry import PartitionState
from dbidx.plain import plain
from dbidx.storage.records import DataFileRecord, DeletionVectorRecord, DvFileRecord


@dataclass
class Inner:
    n: int
    pair: tuple = (1, 2)
    nested: dict = field(default_factory=lambda: {"x": [1, {"y": 2.5}], 3: None})


Pair = namedtuple("Pair", "left right")


@dataclass
class Outer:
    inner: Inner
    items: list
    tags: set = field(default_factory=lambda: {"a"})
    extra: Any = None


def test_plain_equals_asdict_with_the_same_container_types() -> None:
    value = Outer(Inner(1), [Inner(2), (3, "a"), Pair(1, Inner(4))], extra=b"\x00")
    converted = plain(value)
    assert converted == asdict(value)
    assert type(converted["inner"]["pair"]) is tuple and type(converted["items"][2]).__name__ == "Pair"
    assert converted["tags"] is not value.tags  # a leaf that is not immutable is copied, as asdict copies it
    converted["inner"]["nested"]["x"].append(9)
    assert value.inner.nested["x"] == [1, {"y": 2.5}]  # containers are new: changing the result changes nothing


def test_plain_equals_asdict_on_commit_records() -> None:
    data = DataFileRecord(
        path="dt=1/fg-0001-0-x.parquet", partition="dt=1", file_group="fg-0001-0", size=10, checksum="abc", rows=3
    )
    vector = DeletionVectorRecord(path=data.path, dv_file=".dbidx/dv/x.bin", offset=1, size=20, cardinality=2)
    dv_file = DvFileRecord(path=".dbidx/dv/x.bin", size=40, checksum="def")
    state = PartitionState(partition="dt=1", cf="p-1", fills={"dt=1\x00fg-0001-0": 3})
    for record in (data, vector, dv_file, state):
        assert plain(record) == asdict(record)
