"""The Delta table properties dbidx honours (metaData.configuration): how long the log and removed files are kept,
and how often a Delta checkpoint is written; set with `Table.set_delta_properties` / `dbidx config URI delta.*=...`.

Why Delta's own properties and not dbidx settings: every engine that shares the table reads them from the log
(delta-rs drops tombstones older than `delta.deletedFileRetentionDuration` from the checkpoints it writes and
vacuums by it, dbidx's clean keeps the data files it replaced for as long (index/clean.py); Spark expires log files
by `delta.logRetentionDuration`), so one value governs them all. A change is a dbidx completion (`properties`) whose
Delta version is commitInfo + metaData with the whole new configuration, so it is ordered with every other write;
one made by another engine is absorbed and carried on by dbidx's later metaData (table/absorb.py). Values read back
from the log are untrusted: one dbidx cannot parse is a ConfigError naming the key, never a silently assumed default.

Only the `delta.*` keys below can be set through dbidx: another `delta.*` key changes what writers must do (append
only, column mapping, ...), which dbidx would have to honour first. Keys outside `delta.` are free-form user
properties (owner, comment) and are carried as given, but for dbidx's own `dbidx.deletionVectors.storage` (`inline`
or `file`: how dbidx logs its deletion vectors; data/deletion_vectors.vectors_in_files).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

# The parsing of the properties lives a floor lower (data/delta_retention.py: the clean reads them too); their
# names are re-exported here.
from dbidx.data.delta_retention import (  # noqa: F401
    CHECKPOINT_INTERVAL,
    DEFAULTS,
    DELETED_FILE_RETENTION,
    DELETION_VECTORS,
    EXPIRED_LOG_CLEANUP,
    LOG_RETENTION,
    DeltaRetention,
    parse_bool,
    parse_interval,
    parse_positive,
    retention_of,
)
from dbidx.data.column_mapping import schema_string_to_record
from dbidx.data.deletion_vectors import VECTOR_STORAGE, vectors_in_files
from dbidx.errors import ConfigError, ConflictError
from dbidx.storage.data_view import DELTA_CONFIGURATION_EXTRA
from dbidx.storage.records import ACTION_ABSORB, ACTION_PROPERTIES, CompletedInstant
from dbidx.storage.data_view import DataView
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.state import TableState


class PropertiesTable(TableState, Protocol):
    """A table whose Delta properties can change (implemented by `Table`)."""

    def sync_delta_log(self) -> int: ...

    def data_view(self) -> DataView: ...


SETTABLE = tuple(DEFAULTS)


def check_property(key: str, value: Any) -> str:
    """A value to set, checked for its key (ConfigError saying what is wrong); returned as the string Delta stores."""
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"a table property name must be a non-empty string, got {key!r}")
    if key.startswith("delta.") and key not in SETTABLE:
        raise ConfigError(
            f"{key} cannot be set through dbidx (it can set {', '.join(SETTABLE)} and properties "
            "outside delta.*): another delta.* property changes what writers must do, which dbidx "
            "does not do yet"
        )
    if not isinstance(value, str):
        raise ConfigError(f"{key}: a table property value is a string, got {value!r}")
    if key in (LOG_RETENTION, DELETED_FILE_RETENTION):
        if parse_interval(value, key) <= 0:
            raise ConfigError(f"{key} must be longer than 0, got {value!r}")
    elif key == CHECKPOINT_INTERVAL:
        parse_positive(value, key)
    elif key == EXPIRED_LOG_CLEANUP:
        parse_bool(value, key)
    elif key == VECTOR_STORAGE:
        vectors_in_files({key: value})
    return value


def set_delta_properties(table: PropertiesTable, changes: Mapping[str, str | None]) -> CompletedInstant | None:
    """Set (or, with None, remove) table properties as one `properties` completion; None if nothing changes.
    Another properties change that commits meanwhile is a ConflictError (nothing published; set them again)."""
    # 1. Check every change before anything is read or written.
    if not isinstance(changes, Mapping) or not changes:
        raise ConfigError(f"table properties of {table.uri}: give at least one key=value to change")
    for key, value in changes.items():
        if value is None:
            check_property(key, DEFAULTS.get(key, ""))
            if key == DELETION_VECTORS:
                raise ConfigError(f"{key} cannot be removed: dbidx writes deletion vectors")
        else:
            check_property(key, value)
    # 2. The configuration now (other engines' versions absorbed first), and the one after the change.
    table.sync_delta_log()
    before = table.data_view().configuration()
    after = {k: v for k, v in before.items() if not (k in changes and changes[k] is None)}
    after.update({k: v for k, v in changes.items() if v is not None})
    if after == before:
        return None

    def check(news: list[CompletedInstant]) -> None:
        # A change built on a configuration that is no longer the latest would undo the other one.
        for rec in news:
            if rec.action in (ACTION_PROPERTIES, ACTION_ABSORB) and DELTA_CONFIGURATION_EXTRA in rec.extra:
                raise ConflictError(
                    f"the table properties of {table.uri} changed meanwhile (completion {rec.seq}, "
                    f"{rec.instant}); nothing was changed: set them again"
                )

    def build(seq: int) -> CompletedInstant:
        return writer.completion(
            seq,
            table.props.table_id,
            extra={DELTA_CONFIGURATION_EXTRA: after, **schema_string_to_record(table.data_view())},
        )

    # 3. One instant: published, or rolled back (storage/instant_life.py).
    with InstantLife(table.timeline, ACTION_PROPERTIES) as writer:
        return writer.publish(build, check=check)
