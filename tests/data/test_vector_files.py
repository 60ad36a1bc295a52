"""How dbidx logs its deletion vectors: inline by default (delta-rs deadlocks on a table with hundreds of file-backed
ones, delta-io/delta-rs#4657), as pointers into its DV files (`storageType` "u", under `.dbidx/dv/`) on a table whose
`dbidx.deletionVectors.storage` is `file` (Delta Spark's VACUUM fails on inline ones); changing the property moves
every live vector to the new form in one version that changes no row (table/vector_storage.py). Delta Spark's VACUUM
on both: tests/spark_integration/test_delta_spark.py."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote

import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.data import delta_log
from dbidx.data.deletion_vectors import VECTOR_STORAGE
from dbidx.data.delta_actions import dv_file_path
from dbidx.data.delta_scratch import checkpoint_file
from dbidx.errors import ConfigError
from dbidx.storage import layout
from dbidx.table.facade import Table
from dbidx.table.readopt import readopt
from dbidx.table.vector_storage import misplaced_vectors

from tests.data.test_foreign_writers import COLUMNS, Writer
from tests.delta_readers import via_deltalake, via_polars


def _actions(path: str) -> list[dict]:
    """Every action of the JSON log, oldest first (these tests' logs keep all their JSON)."""
    out = []
    for version in delta_log.listed_versions(Table.open(path).io):
        out += [json.loads(x) for x in Path(path, delta_log.version_file(version)).read_text().splitlines()]
    return out


def _live_vectors(path: str) -> dict[str, dict | None]:
    """The live adds of the Delta log at its latest version, by replaying the JSON: path -> deletionVector."""
    live: dict[str, dict | None] = {}
    for action in _actions(path):
        if "remove" in action:
            live.pop(action["remove"]["path"], None)
        if "add" in action:
            live[action["add"]["path"]] = action["add"].get("deletionVector")
    return live


def _forms(path: str) -> set[str]:
    return {dv["storageType"] for dv in _live_vectors(path).values() if dv}


def _config(path: str, value: str) -> dict:
    result = CliRunner().invoke(main, ["config", path, f"{VECTOR_STORAGE}={value}", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_vectors_are_inline_by_default_and_in_dbidx_dv_files_when_the_table_says_file(tmp_path: Path) -> None:
    inline = Writer(tmp_path / "inline")
    inline.touched_update(100)
    assert _forms(inline.path) == {"i"}
    w = Writer(tmp_path / "file")
    _config(w.path, "file")
    Table.open(w.path).compact_data(min_files=1, target_file_bytes=1 << 30)
    w.touched_update(100)
    assert _forms(w.path) == {"u"}
    view = Table.open(w.path).data_view()
    for path, dv in _live_vectors(w.path).items():
        ref = view.vector_of(unquote(path))
        if dv is not None:  # the log's descriptor names the DV file and slot dbidx's own record names
            assert dv_file_path(dv, path) == ref.file.path and dv_file_path(dv, path).startswith(layout.DV_DIR + "/")
            assert (dv["offset"], dv["sizeInBytes"]) == (ref.vector.offset, ref.vector.size)
    assert misplaced_vectors(Table.open(w.path)) == []
    w.check()  # dbidx, deltalake, polars and DuckDB read the same rows, the model's


def test_changing_the_storage_moves_every_vector_in_one_version_that_changes_no_row(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    w.touched_update(100)
    with_vectors = sorted(p for p, dv in _live_vectors(w.path).items() if dv)
    versions = delta_log.listed_versions(Table.open(w.path).io)
    before = {v: sorted(via_deltalake(w.path, COLUMNS, v)) for v in versions[1:]}

    out = _config(w.path, "file")
    assert out["vectors_moved"] == len(with_vectors) > 0
    moved_at = Table.open(w.path).delta_version()
    actions = [json.loads(x) for x in Path(w.path, delta_log.version_file(moved_at)).read_text().splitlines()]
    assert actions[0]["commitInfo"]["operation"] == "REORG"
    pairs = [a.get("add") or a.get("remove") for a in actions[1:]]
    assert sorted(p["path"] for p in pairs) == sorted(with_vectors * 2)
    assert all(p["dataChange"] is False for p in pairs)
    assert Path(w.path, checkpoint_file(moved_at)).exists()  # its tombstones keep no inline vector
    assert _forms(w.path) == {"u"} and misplaced_vectors(Table.open(w.path)) == []
    for version, rows in before.items():  # every earlier version reads as it did
        assert sorted(via_deltalake(w.path, COLUMNS, version)) == rows
    assert sorted(via_polars(w.path, COLUMNS)) == before[versions[-1]]
    w.check()
    again = CliRunner().invoke(main, ["sync", w.path, "--json"])
    assert json.loads(again.output)["vectors_moved"] == 0  # every vector has the form: nothing written
    w.touched_update(200)
    w.check()
    assert _config(w.path, "inline")["vectors_moved"] > 0 and _forms(w.path) == {"i"}
    w.touched_update(300)
    w.check()


def test_a_storage_value_dbidx_does_not_know_is_refused_by_name(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    result = CliRunner().invoke(main, ["config", w.path, f"{VECTOR_STORAGE}=parquet"])
    assert result.exit_code != 0 and VECTOR_STORAGE in result.output and "inline, file" in result.output
    with pytest.raises(ConfigError, match=VECTOR_STORAGE):
        Table.open(w.path).set_delta_properties({VECTOR_STORAGE: "FILE"})


def test_readopt_keeps_the_dv_files_the_log_points_into(tmp_path: Path) -> None:
    """The old index folder goes aside, its DV files stay: every Delta reader still finds the vectors."""
    w = Writer(tmp_path)
    _config(w.path, "file")
    w.touched_update(100)
    moved = readopt(w.path, "id").moved_to
    assert not Path(w.path, moved, "dv").exists() and any(Path(w.path, layout.DV_DIR).iterdir())
    w.check()
    w.touched_update(200)
    w.check()


def test_the_services_log_another_engines_file_vectors_inline_on_an_inline_table(tmp_path: Path) -> None:
    """Another engine's DELETE writes a file-backed vector (as Delta Spark's does) into a table left inline: the
    table services log it inline (delta-rs readers deadlock on hundreds of file-backed ones), rows unchanged."""
    import pyarrow.parquet as pq

    from tests.data.test_delta_adopt import _delete_rows

    w = Writer(tmp_path)
    add = next(a for a in _adds(w.path).values() if a.get("deletionVector") is None)
    first = pq.read_table(Path(w.path, unquote(add["path"]))).column("id")[0].as_py()
    _delete_rows(Path(w.path), add, [0], inline=False)
    w.model.pop((add["partitionValues"]["dt"], first))
    Table.open(w.path).sync_delta_log()
    assert "u" in _forms(w.path) and misplaced_vectors(Table.open(w.path)) == [unquote(add["path"])]
    report = Table.open(w.path).maintain()
    (run,) = [r for r in report.ran if r.service == "vector_storage"]
    assert run.details["vectors_moved"] == 1 and run.details["form"] == "inline"
    assert _forms(w.path) == {"i"}
    w.check()
    w.touched_update(100)
    w.check()


def test_a_truncated_foreign_dv_file_is_refused_by_name_and_nothing_is_absorbed(tmp_path: Path) -> None:
    """Issue 60: a damaged artefact of another engine (its DV file cut short) is a CorruptFileError naming the file,
    exit 4 from the CLI, and the index stays where it was."""
    from tests.data.test_delta_adopt import _delete_rows

    w = Writer(tmp_path)
    table = Table.open(w.path)
    table.refresh(force=True)
    before = table.timeline.latest_seq
    add = next(a for a in _adds(w.path).values() if a.get("deletionVector") is None)
    _delete_rows(Path(w.path), add, [0], inline=False)
    (dv_file,) = [p for p in Path(w.path).glob("deletion_vector_*.bin")]
    dv_file.write_bytes(dv_file.read_bytes()[:-3])
    result = CliRunner().invoke(main, ["sync", w.path])
    assert result.exit_code == 4 and dv_file.name in result.output, result.output
    table = Table.open(w.path)
    table.refresh(force=True)
    assert table.timeline.latest_seq == before


def _adds(path: str) -> dict[str, dict]:
    """The live add actions of the JSON log, by path."""
    adds: dict[str, dict] = {}
    for action in _actions(path):
        if "remove" in action:
            adds.pop(action["remove"]["path"], None)
        if "add" in action:
            adds[action["add"]["path"]] = action["add"]
    return adds
