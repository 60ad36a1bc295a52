"""Point lookups in the persisted index: the live entries of given keys, read from the RLI files of their shards.

Per shard: the files of the (partition, shard) group (the whole shard in global mode), each read whole or only the
row groups whose key range holds a wanted key (`rli_files.read_matching`), every file verified; the latest entry per
key wins and deletes drop out (`rli_files.resolve_latest`). What `Table.lookup` and `dbidx lookup` run.
"""

from __future__ import annotations

import bisect
import difflib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.errors import InvalidInputError
from dbidx.index import rli_files
from dbidx.storage import layout
from dbidx.storage.keys import normalize_keys

from dbidx.storage.state import TableState


def lookup(
    table: TableState,
    keys: Sequence[str] | pa.Array,
    partition: str | None,
    mode: str,
    seek_threshold: float,
    plan: dict[str, int] | None,
) -> pa.Table:
    """Live entries of `keys` (see Table.lookup for the arguments); absent keys are not in the result."""
    if mode not in ("auto", "seek", "scan"):
        raise InvalidInputError(f"lookup mode must be auto, seek or scan, got {mode!r}")
    if partition is None and not table.global_index:
        raise InvalidInputError("lookup in a partitioned index needs the partition path of the keys")
    if partition is not None:
        layout.validate_partition(partition)
    view = table.refresh()
    array = normalize_keys(keys, "lookup key")
    if len(array) == 0:
        return table.schema.empty_table()
    shards = table.shard_of(array)
    pieces = []
    for s in np.unique(shards):
        mine = pc.unique(array.filter(pa.array(shards == s)))
        sorted_keys = sorted(mine.to_pylist())
        found = []
        for record in view.files(None if table.global_index else partition, int(s)):
            rows, how = table.read_index_file(
                record, lambda: rli_files.read_matching(table.io, record, sorted_keys, mine, mode, seek_threshold)
            )
            if plan is not None:
                plan[how] = plan.get(how, 0) + 1
            found.append(rows)
        merged = rli_files.resolve_latest(found, table.schema)
        if table.global_index and partition is not None:
            merged = merged.filter(pc.equal(merged.column(rli_files.PARTITION), partition))
        pieces.append(merged)
    return pa.concat_tables(pieces) if pieces else table.schema.empty_table()


@dataclass
class LookupReport:
    """Where each of some keys is in the index, and whether their partition is in the table at all."""

    found: list[dict[str, Any]]  # the index entry of each key found, in the order asked
    missing: list[str]  # keys not in the index (new keys, if their partition is in the table)
    partition: str | None
    partition_in_table: bool | None  # None: not known (no partition asked, or a global index without data files)
    nearest_partitions: list[str] = field(default_factory=list)  # when the partition is not in the table

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the keys `dbidx lookup --json` prints)."""
        return asdict(self)


def lookup_report(table: TableState, keys: Sequence[str], partition: str | None, mode: str = "auto") -> LookupReport:
    """`Table.lookup` of `keys`, plus whether `partition` is one of the table's (with the nearest ones if not), so a
    key of a partition the table lacks is not mistaken for a new key of an existing one."""
    follow = getattr(table, "follow_delta_log", None)
    if follow is not None:
        follow()  # other engines' versions since the index's last are absorbed first
    rows = table.lookup(list(keys), partition, mode=mode).to_pylist()
    by_key = {row["key"]: row for row in rows}
    report = LookupReport(
        [by_key[k] for k in keys if k in by_key], [k for k in keys if k not in by_key], partition, None
    )
    if partition is not None:
        known = table_partitions(table)
        if known is not None:
            report.partition_in_table = partition in known
            if not report.partition_in_table:
                report.nearest_partitions = nearest(partition, sorted(known))
    return report


def table_partitions(table: TableState) -> set[str] | None:
    """The partitions the table has: of its index (partitioned mode) or of its data files (global mode; None
    when it has none, e.g. an index written without data)."""
    if not table.global_index:
        return {p for p, _shard in table.refresh().groups() if p is not None}
    live = table.data_view().live()
    return {f.record.partition for f in live} if live else None


def nearest(wanted: str, known: list[str], n: int = 5) -> list[str]:
    """Up to n of the sorted `known` names nearest to `wanted`: close spellings first, then its sorted neighbours
    (for dates, the days before and after)."""
    close = difflib.get_close_matches(wanted, known, n=n, cutoff=0.6)
    at = bisect.bisect_left(known, wanted)
    around = known[max(0, at - n // 2) : at + (n + 1) // 2]
    return list(dict.fromkeys(close + around))[:n]
