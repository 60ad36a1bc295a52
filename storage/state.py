"""The table as the operations on it see it (`TableState`): what a commit, a compaction or a lookup reads of a table.

Why a protocol: `table.facade.Table` is the user's entry point and offers those operations as methods
(`new_commit`, `compact`, `compact_data`, `clean`, `lookup`); the modules that implement them take the table as an
argument. Typed against `Table` itself, each would import the module that imports it (a circle); typed against this
protocol, they import only this floor, and `Table`, the one implementation, sits above them all.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence

import numpy as np
import pyarrow as pa

from dbidx.storage.data_view import DataView
from dbidx.storage.index_view import IndexView
from dbidx.storage.fileio import FileIO
from dbidx.storage.properties import TableProperties
from dbidx.storage.records import FileRecord
from dbidx.storage.timeline import Timeline


class TableState(Protocol):
    """A table's storage, properties, timeline and folded views, refreshed on demand (implemented by `Table`)."""

    io: FileIO
    props: TableProperties
    timeline: Timeline

    @property
    def uri(self) -> str: ...

    @property
    def num_shards(self) -> int: ...

    @property
    def global_index(self) -> bool: ...

    @property
    def schema(self) -> pa.Schema: ...

    def shard_of(self, keys: Any) -> np.ndarray: ...

    def refresh(self, force: bool = False) -> IndexView: ...

    def data_view(self) -> DataView: ...

    def held_data_view(self) -> AbstractContextManager[DataView]: ...

    def seq_at(self, point: int | str | None) -> int: ...

    def read_index_file(self, record: FileRecord, read: Any = None) -> Any: ...

    def snapshot(self, partition: str | None, shard: int | None = None, as_of: int | str | None = None) -> pa.Table: ...

    def lookup(
        self,
        keys: Sequence[str] | pa.Array,
        partition: str | None = None,
        mode: str = "auto",
        seek_threshold: float = ...,
        plan: dict[str, int] | None = None,
    ) -> pa.Table: ...
