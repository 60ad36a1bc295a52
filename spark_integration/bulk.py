"""The bulk path: writes whose keys cannot be in the index yet skip the caches altogether.

A table's first write (and a load into partitions the table has never had, in partitioned mode) cannot update or
delete anything, so looking every key up in a shard cache - opening it, loading empty partitions, reading before
writing - is pure cost. The driver checks that no key can exist (from the table's folded state, no Spark job for an
empty table) and records the completion seq it checked at in `TagOptions.bulk_seq`; the shard tasks then tag every
row as an insert (`ShardTagger.tag_new`), write data and index files as usual, and report the checked seq as the
one their keys were tagged against. A writer that commits the same keys meanwhile is a conflict at publish, as for
any upsert; later batches' caches take the new partitions by loading their snapshots (the SST bulk path).
"""

from __future__ import annotations

from typing import Iterable

from dbidx.errors import InvalidInputError
from dbidx.table.facade import Table


def empty_table_seq(table: Table) -> int | None:
    """The completion seq at which the table holds no record at all (no data write, no index file), else None."""
    view = table.data_view()
    if view.writes or table.refresh().groups():
        return None
    return view.applied_seq


def new_partitions_seq(table: Table, partitions: Iterable[str]) -> int:
    """The completion seq at which none of `partitions` has ever been written (partitioned mode); a partition that
    has is an InvalidInputError naming it (a key there could exist: that write is an upsert)."""
    if table.global_index:
        seq = empty_table_seq(table)
        if seq is None:
            raise InvalidInputError(
                f"bulk_insert into the global-index table {table.uri} needs an empty table (a key "
                "may live in any partition, so its keys must be looked up): use upsert"
            )
        return seq
    view = table.refresh()
    written = {stats.partition for stats in view.partition_stats()} | {g[0] for g in view.groups()}
    clash = sorted(set(partitions) & written)
    if clash:
        raise InvalidInputError(
            f"bulk_insert writes only partitions table {table.uri} has never had; {clash[:5]} "
            f"({len(clash)} in all) already hold records: write them with upsert"
        )
    return view.applied_seq
