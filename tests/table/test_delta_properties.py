"""Delta table properties through dbidx (table/delta_properties.py): set and removed as one completion every engine
reads, carried on by dbidx's later metaData (its own and another engine's changes), checked strictly, ordered with
concurrent changes; on real tables written by `upsert_arrow` and read by delta-rs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from dbidx.config import CacheConfig
from dbidx.errors import ConfigError, ConflictError, DeltaFeatureError
from dbidx.table.delta_properties import DEFAULTS, parse_interval, retention_of, set_delta_properties
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage.records import ACTION_PROPERTIES

from tests.delta_readers import assert_readers_agree


def write(table: Table, tmp_path: Path, rows: dict) -> None:
    upsert_arrow(
        pa.table(rows), table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "cache"))
    )


def new_table(tmp_path: Path) -> Table:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    write(table, tmp_path, {"id": ["a", "b"], "dt": ["x", "y"], "v": [1, 2]})
    return table


def delta_config(table: Table) -> dict[str, str]:
    return DeltaTable(table.uri).metadata().configuration


def test_set_and_remove_properties_as_completions_every_engine_reads(tmp_path: Path) -> None:
    table = new_table(tmp_path)
    record = table.set_delta_properties({"delta.logRetentionDuration": "interval 2 days", "owner": "data-eng"})
    assert record is not None and record.action == ACTION_PROPERTIES
    assert delta_config(table) == {
        "delta.enableDeletionVectors": "true",
        "delta.logRetentionDuration": "interval 2 days",
        "owner": "data-eng",
    }
    assert Table.open(table.uri).delta_properties() == delta_config(table)
    assert table.set_delta_properties({"owner": "data-eng"}) is None  # nothing changes: nothing published
    # A later schema change of dbidx's carries the properties on (its metaData is the whole configuration).
    write(table, tmp_path, {"id": ["a", "c"], "dt": ["x", "y"], "v": [3, 4], "w": [1.0, 2.0]})
    assert delta_config(table)["delta.logRetentionDuration"] == "interval 2 days"
    assert "w" in DeltaTable(table.uri).schema().to_arrow().names
    table.set_delta_properties({"owner": None})
    assert "owner" not in delta_config(table)
    assert_readers_agree(table, ["id", "dt", "v"], {("a", "x", 3), ("b", "y", 2), ("c", "y", 4)})
    assert verify_table(Table.open(table.uri)).damaged == []


def test_another_engines_property_change_is_absorbed_and_carried_on(tmp_path: Path) -> None:
    table = new_table(tmp_path)
    DeltaTable(table.uri).alter.set_table_properties({"delta.checkpointInterval": "5"})
    again = Table.open(table.uri)
    assert again.delta_properties()["delta.checkpointInterval"] == "5"
    # dbidx's next metaData (a new column) keeps it, where before it wrote the configuration it started with.
    write(again, tmp_path, {"id": ["d"], "dt": ["x"], "v": [5], "z": ["q"]})
    assert delta_config(again)["delta.checkpointInterval"] == "5"
    assert retention_of(again.delta_properties()).checkpoint_interval == 5
    # Turning deletion vectors off is refused loudly: every dbidx upsert writes them.
    DeltaTable(table.uri).alter.set_table_properties({"delta.enableDeletionVectors": "false"})
    with pytest.raises(DeltaFeatureError, match="deletion vectors"):
        Table.open(table.uri).delta_properties()


def test_bad_keys_and_values_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    table = new_table(tmp_path)
    latest = table.timeline.latest_seq
    for bad in (
        {"delta.appendOnly": "true"},
        {"delta.logRetentionDuration": "7 days"},
        {"delta.logRetentionDuration": "interval 0 days"},
        {"delta.deletedFileRetentionDuration": "soon"},
        {"delta.checkpointInterval": "0"},
        {"delta.checkpointInterval": "ten"},
        {"delta.enableExpiredLogCleanup": "maybe"},
        {"owner": 3},
        {"": "x"},
        {"delta.enableDeletionVectors": None},
        {},
    ):
        with pytest.raises(ConfigError):
            table.set_delta_properties(bad)
    assert table.timeline.latest_seq == latest


def test_intervals_parse_like_delta_and_retention_defaults_are_deltas() -> None:
    assert parse_interval("interval 7 days", "k") == 7 * 86_400_000
    assert parse_interval("INTERVAL 1 hour", "k") == 3_600_000
    assert parse_interval("interval 1 weeks", "k") == parse_interval("interval 168 hours", "k")
    assert parse_interval("interval 90 seconds", "k") == 90_000
    for bad in ("7 days", "interval days", "interval -1 days", "interval 1 fortnight", "", None):
        with pytest.raises(ConfigError):
            parse_interval(bad, "k")  # type: ignore[arg-type]
    defaults = retention_of({})
    assert defaults.log_retention_ms == 30 * 86_400_000 and defaults.deleted_file_retention_ms == 7 * 86_400_000
    assert defaults.checkpoint_interval == 10 and defaults.expired_log_cleanup
    assert set(DEFAULTS) >= {"delta.logRetentionDuration", "delta.deletedFileRetentionDuration"}
    with pytest.raises(ConfigError, match="delta.logRetentionDuration"):
        retention_of({"delta.logRetentionDuration": "a while"})  # another engine's value dbidx cannot read


def test_a_change_built_on_an_older_configuration_conflicts(tmp_path: Path) -> None:
    table = new_table(tmp_path)
    other = Table.open(table.uri)
    # The other process's change commits while this one is between its start and its publish.
    original = table.timeline.publish

    def publish_after_other(*args: object, **kwargs: object):
        other.set_delta_properties({"owner": "b"})
        return original(*args, **kwargs)

    table.timeline.publish = publish_after_other  # type: ignore[method-assign]
    with pytest.raises(ConflictError, match="changed meanwhile"):
        set_delta_properties(table, {"delta.checkpointInterval": "3"})
    table.timeline.publish = original  # type: ignore[method-assign]
    after = Table.open(table.uri)
    assert after.delta_properties()["owner"] == "b" and "delta.checkpointInterval" not in after.delta_properties()
    assert after.timeline.pending() == []  # the refused instant was rolled back
    assert after.set_delta_properties({"delta.checkpointInterval": "3"}) is not None


def test_properties_survive_the_index_checkpoint(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=2)
    write(table, tmp_path, {"id": ["a"], "dt": ["x"], "v": [1]})
    table.set_delta_properties({"delta.deletedFileRetentionDuration": "interval 1 days"})
    write(table, tmp_path, {"id": ["b"], "dt": ["x"], "v": [2]})
    assert table.checkpoint() == table.timeline.latest_seq  # the reopened view starts from this checkpoint
    reopened = Table.open(table.uri)
    assert reopened.delta_properties()["delta.deletedFileRetentionDuration"] == "interval 1 days"
    assert reopened.data_view().delta_configuration is not None
