"""Work a commit does on the timeline that must not grow with the history this process has read (issue 44's
"service time flat as the table grows"): claiming an instant once went through every completion record read since
the table was opened, a list that grows by one per commit for as long as a pipeline keeps its table open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dbidx.table.facade import Table


class CountingList(list):
    """The timeline's in-memory records, counting every walk through them (slices are not walks)."""

    walks = 0

    def __iter__(self) -> Any:
        CountingList.walks += 1
        return super().__iter__()


def test_claiming_an_instant_does_not_walk_the_records_read_so_far(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=0)  # every record stays in memory
    # Two writers that finish out of order: the newest id completes first, so the records' ids are not sorted.
    early, late = table.new_commit(), table.new_commit()
    late.insert("p", ["b"], "fg")
    late.commit()
    early.insert("p", ["a"], "fg")
    early.commit()
    for i in range(8):
        with table.new_commit() as writer:
            writer.insert("p", [f"k{i}"], "fg")
    timeline = table.timeline
    records = timeline.completed()
    assert len(records) == 10 and timeline._records_max_instant == max(int(r.instant) for r in records)
    assert records[0].instant > records[1].instant  # the out-of-order pair above
    # The bound: the largest known id comes from a running maximum, not from going through the records again.
    timeline._records = CountingList(timeline._records)
    CountingList.walks = 0
    assert timeline._max_known_instant() >= max(int(r.instant) for r in records)
    assert CountingList.walks == 0
    # And new ids still sort after every completed one, across more commits of this process.
    for i in range(3):
        with table.new_commit() as writer:
            assert int(writer.instant) > max(int(r.instant) for r in timeline.completed())
            writer.insert("p", [f"n{i}"], "fg")
    assert timeline._records_max_instant == max(int(r.instant) for r in timeline.completed())
    assert Table.open(table.uri).lookup(["a", "b", "n2"], "p").num_rows == 3
