"""The Delta table properties dbidx honours (metaData.configuration): how long the log and removed files are kept,
and how often a Delta checkpoint is written; set with `Table.set_delta_properties` / `dbidx config URI delta.*=...`.

Why Delta's own properties and not dbidx settings: every engine that shares the table reads them from the log
(delta-rs drops tombstones older than `delta.deletedFileRetentionDuration` from the checkpoints it writes and
vacuums by it; Spark expires log files by `delta.logRetentionDuration`), so one value governs them all. A change is
a dbidx completion (`properties`) whose Delta version is commitInfo + metaData with the whole new configuration, so
it is ordered with every other write; one made by another engine is absorbed and carried on by dbidx's later
metaData (table/absorb.py). Values read back from the log are untrusted: one dbidx cannot parse is a ConfigError
naming the key, never a silently assumed default.

Only the `delta.*` keys below can be set through dbidx: another `delta.*` key changes what writers must do (append
only, column mapping, ...), which dbidx would have to honour first. Keys outside `delta.` are free-form user
properties (owner, comment) and are carried as given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

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


LOG_RETENTION = "delta.logRetentionDuration"
DELETED_FILE_RETENTION = "delta.deletedFileRetentionDuration"
CHECKPOINT_INTERVAL = "delta.checkpointInterval"
EXPIRED_LOG_CLEANUP = "delta.enableExpiredLogCleanup"
DELETION_VECTORS = "delta.enableDeletionVectors"
# Delta's defaults (PROTOCOL.md and Delta Spark's DeltaConfigs): what a table without the key gets.
DEFAULTS = {
    LOG_RETENTION: "interval 30 days",
    DELETED_FILE_RETENTION: "interval 1 weeks",
    CHECKPOINT_INTERVAL: "10",
    EXPIRED_LOG_CLEANUP: "true",
}
SETTABLE = tuple(DEFAULTS)
_UNIT_MS = {
    "week": 7 * 86_400_000,
    "day": 86_400_000,
    "hour": 3_600_000,
    "minute": 60_000,
    "second": 1000,
    "millisecond": 1,
}
_INTERVAL = re.compile(r"^\s*interval\s+(\d+)\s+([a-z]+?)s?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class DeltaRetention:
    """The properties the table services act on, parsed."""

    log_retention_ms: int  # log files older than this, below a checkpoint, are expired
    deleted_file_retention_ms: int  # removed files are kept this long (vacuum; tombstones in checkpoints)
    checkpoint_interval: int  # a Delta checkpoint every this many versions
    expired_log_cleanup: bool  # whether expired log files are deleted at all


def parse_interval(text: str, key: str) -> int:
    """Milliseconds of a Delta interval ("interval 7 days", "interval 1 hours", "interval 30 minutes")."""
    m = _INTERVAL.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNIT_MS:
        raise ConfigError(
            f"{key} must be a Delta interval such as 'interval 7 days' (units: weeks, days, hours, "
            f"minutes, seconds, milliseconds), got {text!r}"
        )
    return int(m.group(1)) * _UNIT_MS[unit]


def _parse_bool(text: str, key: str) -> bool:
    if isinstance(text, str) and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    raise ConfigError(f"{key} must be 'true' or 'false', got {text!r}")


def _parse_positive(text: str, key: str) -> int:
    if isinstance(text, str) and text.strip().isdigit() and int(text) >= 1:
        return int(text)
    raise ConfigError(f"{key} must be a whole number >= 1, got {text!r}")


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
        _parse_positive(value, key)
    elif key == EXPIRED_LOG_CLEANUP:
        _parse_bool(value, key)
    return value


def retention_of(configuration: Mapping[str, str]) -> DeltaRetention:
    """The retention properties in force (Delta's defaults for absent keys); a value dbidx cannot parse, set by
    another engine, is a ConfigError naming it."""

    def get(key: str) -> str:
        return configuration.get(key, DEFAULTS[key])

    return DeltaRetention(
        parse_interval(get(LOG_RETENTION), LOG_RETENTION),
        parse_interval(get(DELETED_FILE_RETENTION), DELETED_FILE_RETENTION),
        _parse_positive(get(CHECKPOINT_INTERVAL), CHECKPOINT_INTERVAL),
        _parse_bool(get(EXPIRED_LOG_CLEANUP), EXPIRED_LOG_CLEANUP),
    )


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
            extra={DELTA_CONFIGURATION_EXTRA: after},
        )

    # 3. One instant: published, or rolled back (storage/instant_life.py).
    with InstantLife(table.timeline, ACTION_PROPERTIES) as writer:
        return writer.publish(build, check=check)
