"""Another engine changes a column's type (issue 63, item 2): delta-rs `write_deltalake(..., mode="overwrite",
schema_mode="overwrite")` turning `v` from int64 into string. dbidx refuses that version by name (docs/FORMAT.md
section 12c) with nothing absorbed and nothing written, so its next upsert cannot put an int64 file into a column
the Delta log says is string (which broke polars' reads of the whole table, even after a re-adoption); after the
remedy it names (re-adopt), an int64 upsert is refused by name before anything is written, a string one goes in,
and every Delta reader reads the table. A rewrite that keeps every column's Delta type (other Arrow spellings,
other nullability) is absorbed as before; a widening is refused by name too, for now."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable, write_deltalake

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data import delta_log, reads
from dbidx.errors import DeltaFeatureError, SchemaError
from dbidx.spark_integration import task
from dbidx.spark_integration.local import upsert_arrow
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table

from tests.data.test_foreign_writers import COLUMNS, Writer
from tests.delta_readers import assert_readers_agree

NEW_ROWS = {("k3", "d1", "seven"), ("k4", "d2", "eight"), ("s1", "d3", "nine")}
REFUSED = r"Delta version \d+ \(WRITE by delta-rs[^)]*\) changes the type of column\(s\) 'v' from long to string"
REMEDY = "`dbidx build-index URI --key id --readopt`"


def _string_overwrite(path: str) -> None:
    """The other engine's version: the table's rows replaced by rows whose `v` is a string."""
    ids, days, values = (list(c) for c in zip(*sorted(NEW_ROWS)))
    data = pa.table({"id": ids, "dt": days, "v": values})
    write_deltalake(path, data, partition_by=["dt"], mode="overwrite", schema_mode="overwrite")


def _files(root: str) -> dict[str, int]:
    """Every file of the table (data, Delta log and dbidx's own folder) with its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in Path(root).rglob("*") if p.is_file()}


def _int_rows(rows: list[tuple[str, str, int]]) -> pa.Table:
    ids, days, values = (list(c) for c in zip(*rows))
    return pa.table({"id": ids, "dt": days, "v": pa.array(values, pa.int64())})


def _upsert(w: Writer, data: pa.Table) -> None:
    upsert_arrow(data, Table.open(w.path), key="id", partition="dt", cache_config=w.config)


def test_a_type_change_is_refused_by_name_and_nothing_is_absorbed_or_written(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    _string_overwrite(w.path)
    foreign = max(delta_log.listed_versions(w.table.io))
    before = _files(w.path)
    opened = Table.open(w.path)
    opened.refresh()
    seq = opened.timeline.latest_seq
    # The next dbidx upsert (int64 values, as the table's recorded schema says) and a read both refuse by name.
    with pytest.raises(DeltaFeatureError, match=REFUSED) as caught:
        _upsert(w, _int_rows([("k1", "d2", 9)]))
    assert REMEDY in str(caught.value) and "widening" in str(caught.value)
    with pytest.raises(DeltaFeatureError, match=REFUSED):
        reads.read_arrow(Table.open(w.path))
    # Nothing absorbed, nothing written: no record, no Delta version, no data or index file.
    assert _files(w.path) == before
    again = Table.open(w.path)
    again.refresh()
    assert again.timeline.latest_seq == seq
    assert max(delta_log.listed_versions(again.io)) == foreign
    # verify says so and exits non-zero; every Delta reader reads the other engine's table as it wrote it.
    check = verify_table(Table.open(w.path))
    assert not check.ok and any("'v' from long to string" in d["problem"] for d in check.damaged)
    result = CliRunner().invoke(main, ["verify", w.path])
    assert result.exit_code != 0, result.output
    assert set(pl.read_delta(w.path).select(COLUMNS).rows()) == NEW_ROWS


def test_after_the_readopt_it_names_int64_upserts_are_refused_and_polars_reads_the_table(tmp_path: Path) -> None:
    """The issue's sequence: another engine's type change, dbidx's int64 upsert, `--readopt`, int64 again."""
    w = Writer(tmp_path)
    _string_overwrite(w.path)
    with pytest.raises(DeltaFeatureError, match=REFUSED):
        _upsert(w, _int_rows([("k1", "d2", 9)]))
    # The remedy the refusal names: re-adopt the table as it is now.
    result = CliRunner().invoke(main, ["build-index", w.path, "--key", "id", "--readopt", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["old_index_moved_to"].startswith(".dbidx-replaced-")
    assert Table.open(w.path).data_schema().field("v").type == pa.string()
    # An int64 upsert into the string column is refused by name before anything is written (not cast: dbidx
    # refuses every type that differs from the table's, and a silent int-to-string cast would hide the
    # pipeline's mistake); polars reads the table as before.
    before = _files(w.path)
    with pytest.raises(SchemaError, match=r"column 'v' is int64, the table's schema says string"):
        _upsert(w, _int_rows([("k3", "d1", 7), ("n1", "d2", 8)]))
    assert _files(w.path) == before
    assert set(pl.read_delta(w.path).select(COLUMNS).rows()) == NEW_ROWS
    # Data of the new type goes in; every Delta reader and dbidx read the same rows, and verify is clean.
    _upsert(w, pa.table({"id": ["k3", "n1"], "dt": ["d1", "d2"], "v": ["seven!", "ten"]}))
    expected = (NEW_ROWS - {("k3", "d1", "seven")}) | {("k3", "d1", "seven!"), ("n1", "d2", "ten")}
    table = Table.open(w.path)
    assert set(assert_readers_agree(table, COLUMNS)) == expected
    assert verify_table(table).ok


def test_a_type_change_racing_a_dbidx_upsert_rolls_the_upsert_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other engine's version lands while dbidx's tasks write int64 files (the log still said long when they
    began): the publish absorbs it first and refuses by name, so the Delta log never lists one of those files."""
    w = Writer(tmp_path)
    real = task.upsert_batches
    fired: list[bool] = []

    def tasks_then_type_change(*args, **kwargs):
        result = real(*args, **kwargs)
        if not fired:  # after the first shard's task wrote its files
            fired.append(True)
            _string_overwrite(w.path)
        return result

    versions = len(delta_log.listed_versions(w.table.io))
    monkeypatch.setattr(task, "upsert_batches", tasks_then_type_change)
    with pytest.raises(DeltaFeatureError, match=REFUSED):
        _upsert(w, _int_rows([("z1", "d2", 9), ("z2", "d3", 10)]))  # keys the overwrite does not touch
    monkeypatch.undo()
    assert set(pl.read_delta(w.path).select(COLUMNS).rows()) == NEW_ROWS
    live = {Path(u).name for u in DeltaTable(w.path).file_uris()}
    assert all(name.startswith("part-") for name in live)  # delta-rs's files only, none of dbidx's
    assert max(delta_log.listed_versions(w.table.io)) == versions  # the overwrite's version, none after it


def test_verify_reports_a_recorded_schema_the_delta_log_disagrees_with(tmp_path: Path) -> None:
    """What an older dbidx left when it absorbed a type change silently: its recorded schema says long, the Delta
    log's newest metaData string (here the log is edited behind dbidx's back to get there)."""
    w = Writer(tmp_path)
    assert verify_table(Table.open(w.path)).ok
    log = Path(w.path, "_delta_log")
    newest = max(
        (p for p in log.glob("*.json") if '"metaData"' in p.read_text()), key=lambda p: int(p.name.split(".")[0])
    )
    lines = []
    for line in newest.read_text().splitlines():
        action = json.loads(line)
        if "metaData" in action:
            schema = json.loads(action["metaData"]["schemaString"])
            for field in schema["fields"]:
                field["type"] = "string" if field["name"] == "v" else field["type"]
            action["metaData"]["schemaString"] = json.dumps(schema)
        lines.append(json.dumps(action))
    newest.write_text("\n".join(lines) + "\n")
    check = verify_table(Table.open(w.path))
    assert not check.ok
    problems = [d["problem"] for d in check.damaged]
    assert any("column 'v' is string in the Delta log's schema but long in dbidx's" in p for p in problems), problems
    assert any(REMEDY in p for p in problems)
    result = CliRunner().invoke(main, ["verify", w.path])
    assert result.exit_code != 0, result.output


def test_a_rewrite_keeping_every_delta_type_is_absorbed_and_a_widening_is_refused_by_name(tmp_path: Path) -> None:
    """No false alarm: the other engine's Arrow spellings (string for dbidx's large_string, a non-null column) name
    the same Delta types. A widening (integer to long) is a type change, refused by name for now."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    path, config = table.io.path(""), CacheConfig(base_path=str(tmp_path / "cache"))
    ts = pa.array([0, 1], pa.timestamp("us", tz="UTC"))
    first = pa.table(
        {
            "id": pa.array(["a", "b"], pa.large_string()),
            "dt": ["d1", "d2"],
            "n": pa.array([1, 2], pa.int32()),
            "ts": ts,
        }
    )
    upsert_arrow(first, table, key="id", partition="dt", cache_config=config)
    same = pa.table(
        {
            "id": pa.array(["a", "c"], pa.string()),
            "dt": ["d1", "d2"],
            "n": pa.array([3, 4], pa.int32()),
            "ts": ts,
        },
        schema=pa.schema(
            [
                pa.field("id", pa.string(), nullable=False),
                pa.field("dt", pa.string()),
                pa.field("n", pa.int32(), nullable=False),
                pa.field("ts", pa.timestamp("us", tz="UTC")),
            ]
        ),
    )
    write_deltalake(path, same, partition_by=["dt"], mode="overwrite", schema_mode="overwrite")
    assert sorted(reads.read_arrow(Table.open(path), columns=["id", "n"]).to_pylist(), key=str) == [
        {"id": "a", "n": 3},
        {"id": "c", "n": 4},
    ]
    wider = same.set_column(2, "n", pa.array([5, 6], pa.int64()))
    write_deltalake(path, wider, partition_by=["dt"], mode="overwrite", schema_mode="overwrite")
    with pytest.raises(DeltaFeatureError, match=r"'n' from integer to long.*widenings included"):
        reads.read_arrow(Table.open(path))
