"""Issue 29, point 1 after the audit: a table the old rollback bug already bricked (an instant id at the end of the
17-digit range in a stray timeline file or a checkpoint) is reported by verify, named by the writer's error, and
repaired or healed with nothing lost."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import checkpoint, layout, markers
from dbidx.storage.records import ACTION_ROLLBACK, CompletedInstant

FAR = "99999999999999999"


def rows(ids: list[str], v: int = 1) -> pa.Table:
    return pa.table({"id": ids, "dt": ["2025-03-01"] * len(ids), "v": pa.array([v] * len(ids), pa.int64())})


def _table(tmp_path: Path, checkpoint_interval: int = 100) -> tuple[Table, CacheConfig]:
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=checkpoint_interval)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a", "b"]), table, key="id", partition="dt", cache_config=config)
    return table, config


def _ids(table: Table) -> list[str]:
    return sorted(read_arrow(Table.open(table.uri)).column("id").to_pylist())


@pytest.mark.parametrize("kind", ["requested", "inflight"])
def test_a_stray_timeline_file_at_the_end_of_the_range_is_named_reported_and_repaired(
    tmp_path: Path, kind: str
) -> None:
    table, config = _table(tmp_path)
    stray = Path(table.io.path(layout.TIMELINE_DIR)) / f"{FAR}.{kind}"
    planned = f"dt=2025-03-01/{FAR}-0.parquet"  # a file the stray instant planned: no completion lists it
    stray.write_text(json.dumps({"action": "commit", "files": [planned]}) if kind == "inflight" else "{}")
    table.io.write_atomic(planned, b"never listed")
    markers.announce(table.io, FAR, planned)
    # 1. The writer's error names the file and the fix.
    with pytest.raises(CorruptFileError) as err:
        upsert_arrow(rows(["c"]), table, key="id", partition="dt", cache_config=config)
    assert str(stray) in str(err.value) and "dbidx repair" in str(err.value) and FAR in str(err.value)
    runner = CliRunner()
    for args in [[FAR]] + [["--all-pending"]] * (kind == "requested"):  # an inflight alone is not pending
        result = runner.invoke(main, ["rollback", table.uri, *args])
        assert result.exit_code == 4 and "dbidx repair" in result.output, result.output
    # 2. verify reports it: not ok in the library, exit 4 in the CLI, the id in the output.
    assert not verify_table(Table.open(table.uri)).ok
    result = runner.invoke(main, ["verify", table.uri])
    assert result.exit_code == 4 and FAR in result.output and str(stray) in result.output, result.output
    # 3. repair removes it (and the files it planned); nothing live is lost and writers claim instants again.
    result = runner.invoke(main, ["repair", table.uri, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["out_of_range_removed"] == [f"{layout.TIMELINE_DIR}/{stray.name}"]
    assert not stray.exists() and not table.io.exists(planned) and not table.io.exists(markers.marker_dir(FAR))
    assert runner.invoke(main, ["verify", table.uri]).exit_code == 0
    upsert_arrow(rows(["c"]), Table.open(table.uri), key="id", partition="dt", cache_config=config)
    assert _ids(table) == ["a", "b", "c"]
    table.timeline.refresh()
    assert not layout.instant_out_of_range(table.timeline.completed()[-1].instant)


def test_a_checkpoint_whose_max_instant_is_out_of_range_is_recomputed(tmp_path: Path) -> None:
    """Older dbidx wrote a typo's rolled-back id into the checkpoint's max_instant: the timeline recomputes it from
    the records, so writers go on, and the next checkpoint stores the real largest id."""
    table, config = _table(tmp_path, checkpoint_interval=2)
    upsert_arrow(rows(["c"]), table, key="id", partition="dt", cache_config=config)
    seq = checkpoint.checkpoint_seqs(table.io)[-1]
    cp = checkpoint.read_checkpoint(table.io, seq, table.props.table_id)
    payload = {
        "format": checkpoint.CHECKPOINT_FORMAT,
        "table_id": table.props.table_id,
        "seq": cp.seq,
        "max_instant": FAR,
        "index": cp.index,
        "data": cp.data,
    }
    Path(table.io.path(layout.checkpoint_file(seq))).write_bytes(checkpoint.seal(payload))
    reopened = Table.open(table.uri)
    for v in range(2, 5):
        upsert_arrow(rows(["a", "d"], v=v), reopened, key="id", partition="dt", cache_config=config)
    newest = checkpoint.read_checkpoint(table.io, checkpoint.checkpoint_seqs(table.io)[-1], table.props.table_id)
    assert newest.seq > seq and not layout.instant_out_of_range(newest.max_instant)
    assert newest.max_instant == max(r.instant for r in reopened.timeline.completed(upto_seq=newest.seq))
    assert _ids(table) == ["a", "b", "c", "d"] and verify_table(Table.open(table.uri)).ok


def test_allocation_and_checkpoints_ignore_an_id_a_rollback_record_merely_names(tmp_path: Path) -> None:
    """A rollback record that names an id of the end of the range (what older dbidx published for a typo) never
    moves allocation: the checkpoint after it stores the largest id a record has as its own."""
    table, config = _table(tmp_path, checkpoint_interval=3)
    me = table.timeline.start(ACTION_ROLLBACK)
    table.timeline.publish(
        me,
        lambda seq: CompletedInstant(
            seq=seq,
            instant=me.instant,
            action=ACTION_ROLLBACK,
            start_seq=me.start_seq,
            table_id=table.props.table_id,
            completed_at_ms=int(time.time() * 1000),
            rolled_back=FAR,
        ),
    )
    upsert_arrow(rows(["c"]), table, key="id", partition="dt", cache_config=config)  # seq 3: a checkpoint
    seq = checkpoint.checkpoint_seqs(table.io)[-1]
    assert seq == 3
    cp = checkpoint.read_checkpoint(table.io, seq, table.props.table_id)
    assert cp.max_instant == table.timeline.completed()[-1].instant
    upsert_arrow(rows(["d"]), Table.open(table.uri), key="id", partition="dt", cache_config=config)
    assert _ids(table) == ["a", "b", "c", "d"]


def test_a_completion_record_with_an_out_of_range_instant_is_reported_as_damage(tmp_path: Path) -> None:
    table, config = _table(tmp_path)
    me = table.timeline.start(ACTION_ROLLBACK)
    table.timeline.publish(
        me,
        lambda seq: CompletedInstant(
            seq=seq,
            instant=FAR,
            action=ACTION_ROLLBACK,
            start_seq=me.start_seq,
            table_id=table.props.table_id,
            completed_at_ms=int(time.time() * 1000),
            rolled_back=me.instant,
        ),
    )
    with pytest.raises(CorruptFileError, match="completion record seq 2 .*backup"):
        upsert_arrow(rows(["c"]), Table.open(table.uri), key="id", partition="dt", cache_config=config)
    check = verify_table(Table.open(table.uri))
    assert not check.ok and any(FAR in d["problem"] for d in check.damaged)


def test_a_stray_file_of_an_id_a_rollback_record_names_is_reported_and_repaired(tmp_path: Path) -> None:
    """What the old bug left when its rollback died before deleting the files: the record settles the id, the file
    still stops `dbidx rollback` (which does not sweep first); verify names it and repair sweeps it."""
    table, config = _table(tmp_path)
    me = table.timeline.start(ACTION_ROLLBACK)
    table.timeline.publish(
        me,
        lambda seq: CompletedInstant(
            seq=seq,
            instant=me.instant,
            action=ACTION_ROLLBACK,
            start_seq=me.start_seq,
            table_id=table.props.table_id,
            completed_at_ms=int(time.time() * 1000),
            rolled_back=FAR,
        ),
    )
    stray = Path(table.io.path(layout.requested_file(FAR)))
    stray.write_text("{}")
    with pytest.raises(CorruptFileError, match=f"{stray}.*a rollback record names.*dbidx repair"):
        Table.open(table.uri).timeline.start("commit")
    result = CliRunner().invoke(main, ["verify", table.uri])
    assert result.exit_code == 4 and str(stray) in result.output, result.output
    assert CliRunner().invoke(main, ["repair", table.uri]).exit_code == 0 and not stray.exists()
    upsert_arrow(rows(["c"]), Table.open(table.uri), key="id", partition="dt", cache_config=config)
    assert _ids(table) == ["a", "b", "c"] and verify_table(Table.open(table.uri)).ok
