"""The Delta table properties that say how long the table keeps its past (metaData.configuration), parsed: how long
log files and removed files are kept, and how often a Delta checkpoint is written.

Why a module on this floor: the clean (index/clean.py) must not delete a data or deletion-vector file a Delta
version within `delta.deletedFileRetentionDuration` still reads, the Delta log cleanup and the vacuum go by the same
values, and they sit on different floors; setting the properties is the table's (table/delta_properties.py, which
re-exports these names). Values read back from the log are untrusted: one dbidx cannot parse is a ConfigError naming
the key, never a silently assumed default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from dbidx.errors import ConfigError

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
    deleted_file_retention_ms: int  # removed files are kept this long (clean, vacuum; tombstones in checkpoints)
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


def parse_bool(text: str, key: str) -> bool:
    """A Delta boolean property ('true' / 'false', any case)."""
    if isinstance(text, str) and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    raise ConfigError(f"{key} must be 'true' or 'false', got {text!r}")


def parse_positive(text: str, key: str) -> int:
    """A Delta count property (a whole number >= 1)."""
    if isinstance(text, str) and text.strip().isdigit() and int(text) >= 1:
        return int(text)
    raise ConfigError(f"{key} must be a whole number >= 1, got {text!r}")


def retention_of(configuration: Mapping[str, str]) -> DeltaRetention:
    """The retention properties in force (Delta's defaults for absent keys); a value dbidx cannot parse, set by
    another engine, is a ConfigError naming it."""

    def get(key: str) -> str:
        return configuration.get(key, DEFAULTS[key])

    return DeltaRetention(
        parse_interval(get(LOG_RETENTION), LOG_RETENTION),
        parse_interval(get(DELETED_FILE_RETENTION), DELETED_FILE_RETENTION),
        parse_positive(get(CHECKPOINT_INTERVAL), CHECKPOINT_INTERVAL),
        parse_bool(get(EXPIRED_LOG_CLEANUP), EXPIRED_LOG_CLEANUP),
    )
