"""The life of an instant, written once (storage/instant_life.py): a failure before the publish rolls the instant
back and deletes every file it declared or announced; a failure after the publish (another engine took its Delta
version: ForeignCommitAfterPublishError) is never rolled back; a success publishes exactly once and deletes what the
instant wrote but does not list. Real tables on tmp_path, real Parquet files, no stand-in for storage."""

from __future__ import annotations

import io as pyio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dbidx.data import delta_log
from dbidx.errors import ConflictError, ForeignCommitAfterPublishError, ForeignCommitError
from dbidx.storage import layout, markers
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.records import ACTION_COMMIT, ACTION_COMPACTION, ACTION_ROLLBACK
from dbidx.table.facade import Table


class Boom(RuntimeError):
    """The instant's work failing (a task, a merge, a check)."""


@pytest.fixture()
def table(tmp_path: Path) -> Table:
    return Table.create(str(tmp_path / "t"), num_shards=1)


def write_parquet(table: Table, rel: str) -> None:
    """A real Parquet file at a table-relative path (what a piece of an instant's work writes)."""
    sink = pyio.BytesIO()
    pq.write_table(pa.table({"k": ["a", "b"], "v": [1, 2]}), sink)
    table.io.write_atomic(rel, sink.getvalue())


def losing_attempt(table: Table, instant: str, rel: str) -> str:
    """A file a second try of a piece wrote, announced first (as runner.py and the upsert tasks do): no record lists
    it."""
    markers.announce(table.io, instant, rel)
    write_parquet(table, rel)
    return rel


def records_of(table: Table, instant: str) -> list:
    table.refresh()
    return [r for r in table.timeline.completed() if instant in (r.instant, r.rolled_back)]


def test_a_failure_before_the_publish_rolls_back_and_deletes_what_the_instant_wrote(table: Table) -> None:
    with pytest.raises(Boom):
        with InstantLife(table.timeline, ACTION_COMPACTION) as life:
            planned = layout.rli_file("p", 0, "base", life.instant)
            life.declare([planned])
            write_parquet(table, planned)
            retried = losing_attempt(table, life.instant, layout.rli_file("p", 0, "base", life.instant, 1))
            assert table.io.exists(planned) and table.io.exists(retried)
            raise Boom("the merge failed")
    [rollback] = records_of(table, life.instant)
    assert rollback.action == ACTION_ROLLBACK and rollback.rolled_back == life.instant
    assert life.rolled_back == rollback and not life.published
    assert not table.io.exists(planned) and not table.io.exists(retried)
    assert not table.io.exists(markers.marker_dir(life.instant))
    assert table.timeline.pending() == []


def test_a_block_left_without_a_publish_ends_rolled_back(table: Table) -> None:
    with InstantLife(table.timeline, ACTION_COMPACTION) as life:
        pass  # nothing to publish after all
    assert [r.action for r in records_of(table, life.instant)] == [ACTION_ROLLBACK]
    assert table.timeline.pending() == []


def test_the_table_hands_out_an_instant_life(table: Table) -> None:
    """`table.instant(action)`: the same life, claimed on the table's timeline."""
    with pytest.raises(Boom):
        with table.instant(ACTION_COMPACTION, tags={"job": "nightly"}) as life:
            assert isinstance(life, InstantLife) and life.instant in table.timeline.pending()
            raise Boom("the work failed")
    assert [r.action for r in records_of(table, life.instant)] == [ACTION_ROLLBACK]
    assert table.timeline.pending() == []


def test_a_commit_that_loses_its_check_is_rolled_back_with_its_files(table: Table) -> None:
    """A real failure before the publish: another writer committed the same key meanwhile (ConflictError)."""
    writer = table.new_commit()
    writer.insert("p", ["a"], "fg-1")
    retried = losing_attempt(table, writer.instant, layout.delta_file("p", 0, writer.instant, 1))
    with Table.open(table.uri).new_commit() as other:
        other.insert("p", ["a"], "fg-2")
    with pytest.raises(ConflictError):
        writer.commit()
    assert [r.action for r in records_of(table, writer.instant)] == [ACTION_ROLLBACK]
    # Its own delta (declared and written before the check) and the announced file are gone.
    assert not table.io.exists(layout.delta_file("p", 0, writer.instant))
    assert not table.io.exists(retried)
    assert table.timeline.pending() == []
    writer.rollback()  # idempotent
    assert [r.action for r in records_of(table, writer.instant)] == [ACTION_ROLLBACK]


def test_a_failure_after_the_publish_is_not_rolled_back(table: Table) -> None:
    """Another engine takes the completion's Delta version once dbidx has published it: the publishing call raises
    the typed error (still a ForeignCommitError), naming the record; the instant stays committed, and what it wrote
    without listing goes."""
    with table.new_commit() as first:
        first.insert("p", ["a"], "fg-1")

    def another_engine_takes_the_version(record) -> None:
        foreign = {"commitInfo": {"timestamp": 1, "operation": "VACUUM START", "engineInfo": "another"}}
        Path(table.io.path(delta_log.version_file(record.seq))).write_text(json.dumps(foreign) + "\n")
        Table.open(table.uri).sync_delta_log()  # what every other process now finds: ForeignCommitError

    table.timeline.after_publish.insert(0, another_engine_takes_the_version)
    writer = table.new_commit()
    writer.insert("p", ["b"], "fg-1")
    retried = losing_attempt(table, writer.instant, layout.delta_file("p", 0, writer.instant, 1))
    with pytest.raises(ForeignCommitError, match="completed at seq 2 in dbidx's completion log") as caught:
        writer.commit()
    assert isinstance(caught.value, ForeignCommitAfterPublishError)
    assert caught.value.published.instant == writer.instant and writer.record == caught.value.published
    table.timeline.after_publish.remove(another_engine_takes_the_version)
    [record] = records_of(table, writer.instant)
    assert record.action == ACTION_COMMIT and record.seq == 2  # committed, never rolled back
    assert all(table.io.exists(f.path) for f in record.files)
    assert not table.io.exists(retried) and not table.io.exists(markers.marker_dir(writer.instant))
    assert table.timeline.pending() == []
    writer.rollback()  # a published instant is never rolled back
    assert [r.action for r in records_of(table, writer.instant)] == [ACTION_COMMIT]


def test_a_success_publishes_once_and_deletes_what_it_did_not_list(table: Table) -> None:
    versions = delta_log.listed_versions(table.io)
    writer = table.new_commit()
    writer.insert("p", ["a", "b"], "fg-1")
    retried = losing_attempt(table, writer.instant, layout.delta_file("p", 0, writer.instant, 1))
    record = writer.commit()
    assert writer.finish() == [retried]
    assert records_of(table, writer.instant) == [record] and record.action == ACTION_COMMIT
    assert delta_log.listed_versions(table.io) == versions + [record.seq]  # one Delta version, its own
    assert [f.path for f in record.files] == [layout.delta_file("p", 0, writer.instant)]
    assert table.io.exists(record.files[0].path) and not table.io.exists(retried)
    assert not table.io.exists(markers.marker_dir(writer.instant))
    assert table.timeline.pending() == []
    # Ended: neither a second publish nor a rollback changes anything.
    writer.rollback()
    assert writer.finish() == [retried]
    assert records_of(table, writer.instant) == [record]


def test_an_index_compaction_deletes_a_retried_pieces_file(table: Table, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller of the life: index compaction, whose merge ran twice (a retried piece); the record lists one
    base, the other try's goes."""
    from dbidx.index import compaction

    for key in ("a", "b"):
        with table.new_commit() as writer:
            writer.insert("p", [key], "fg-1")
    real, extra = compaction.merge_group, []

    def merged_twice(io, instant, schema, row_group_size, item, attempt):
        extra.append(losing_attempt(table, instant, layout.rli_file("p", 0, "base", instant, 7)))
        return real(io, instant, schema, row_group_size, item, attempt)

    monkeypatch.setattr(compaction, "merge_group", merged_twice)
    result = table.compact()
    assert result.record is not None and [r.action for r in records_of(table, result.record.instant)] == [
        ACTION_COMPACTION
    ]
    assert extra and not table.io.exists(extra[0])
    assert all(table.io.exists(f.path) for f in result.record.files)
    assert table.timeline.pending() == []
