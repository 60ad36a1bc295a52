"""Table service settings: which maintenance runs by itself, when, and within what budget (`.dbidx/services.json`,
docs/FORMAT.md section 3a).

Why a file of its own: `table.json` is fixed at creation and older readers refuse unknown fields in it, while these
settings change over a table's life and no reader needs them to read the table. The file holds only the keys someone
set; every other key has its default, so a table without the file runs the defaults (on, with thresholds that keep
a table healthy). It is read back as untrusted input: an unknown key, a value of the wrong type or out of range is a
CorruptFileError naming the key and the file. A value set from Python or the CLI is checked the same way before
anything is written (ConfigError).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from dbidx.errors import ConfigError, CorruptFileError
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO

SERVICES_FILE = f"{layout.META_DIR}/services.json"
SERVICES_FORMAT = 1
_TRUE = {"true", "on", "yes", "1"}
_FALSE = {"false", "off", "no", "0"}


@dataclass(frozen=True)
class ServiceSettings:
    """What the table services do by themselves: triggers per service and the budget of one run."""

    after_commit: bool = True  # run the services in the writer after each upsert's publish
    spark_jobs: bool = True  # after a Spark upsert, the compactions' pieces run as Spark jobs (False: in the driver)
    spark_jobs_min_mb: int = 64  # ... those of a compaction reading at least this much; smaller ones in the driver
    data_compaction: bool = True
    data_min_small_files: int = 10  # a file group is compacted once it has this many small files
    data_small_file_mb: int = 64  # files under this size count as small (and bases are not rewritten again)
    data_deleted_share: float = 0.2  # a file with this share of its rows deleted is rewritten
    data_base_share: float = 0.25  # a group's largest small file is rewritten only once the rest holds this share
    # of its bytes (0: always: one file per group after each compaction)
    index_compaction: bool = True
    index_min_files: int = 10  # an index group (partition, shard) is compacted at this many files
    index_base_share: float = 0.25  # ... into a new base only once the files after its base hold this share of the
    # base's entries, before that its newest files into one merged file (0: always into a new base)
    clean: bool = True
    # Replaced index files are kept this many completions (caches' catch-up, index snapshots); data and DV files
    # at least as many, and always delta.deletedFileRetentionDuration (the Delta property; index/clean.py).
    clean_retain_completions: int = 10
    clean_interval: int = 10  # at most one clean per this many completions
    log_cleanup: bool = True  # Delta checkpoints every delta.checkpointInterval versions; log files expired by
    # delta.logRetentionDuration (table/delta_properties.py: Delta's own properties, shared with other engines)
    vacuum: bool = True  # files no version references, removed longer than delta.deletedFileRetentionDuration ago
    vacuum_interval_hours: float = 24.0  # at most one vacuum per this many hours (it lists the whole table)
    budget_seconds: float = 30.0  # a run starts no new step once this much time has passed
    budget_files: int = 2000  # data files rewritten per run at most (index files are cheap)

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value (the JSON form `dbidx config --json` and the run reports show)."""
        return asdict(self)

    def changed(self) -> dict[str, Any]:
        """Only the keys whose value differs from the default (what the file stores)."""
        default = ServiceSettings()
        return {k: v for k, v in asdict(self).items() if getattr(default, k) != v}


_RANGES: dict[str, tuple[float, float]] = {
    "data_min_small_files": (2, 1 << 20),
    "data_small_file_mb": (1, 1 << 20),
    "index_min_files": (2, 1 << 20),
    "clean_retain_completions": (0, 1 << 30),
    "clean_interval": (1, 1 << 30),
    "budget_files": (1, 1 << 30),
    "budget_seconds": (0.001, 86400.0),
    "vacuum_interval_hours": (0.001, 8760.0),
    "spark_jobs_min_mb": (0, 1 << 30),
    "data_base_share": (0.0, 1e6),
    "index_base_share": (0.0, 1e6),
}
KEYS: tuple[str, ...] = tuple(f.name for f in fields(ServiceSettings))


def check_value(key: str, value: Any) -> Any:
    """The value checked for its key (a ValueError saying what is wrong; callers add where it came from)."""
    kind = type(getattr(ServiceSettings(), key))
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        value = float(value)
    if key == "data_deleted_share":
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{key} must be in (0, 1], got {value!r}")
        return value
    low, high = _RANGES[key]
    if not low <= value <= high:
        raise ValueError(f"{key} must be in {low:g}..{high:g}, got {value!r}")
    return value


def with_changes(settings: ServiceSettings, changes: Mapping[str, Any]) -> ServiceSettings:
    """Settings with the given keys changed (None: back to the default), each checked (ConfigError naming it)."""
    values: dict[str, Any] = {}
    for key, value in changes.items():
        if key not in KEYS:
            raise ConfigError(f"unknown table service setting {key!r}; known: {', '.join(KEYS)}")
        try:
            values[key] = getattr(ServiceSettings(), key) if value is None else check_value(key, value)
        except ValueError as exc:
            raise ConfigError(f"table service setting {exc}") from exc
    return replace(settings, **values)


def parse_text(key: str, text: str) -> Any:
    """A `key=value` value from the command line in its key's type; `default` resets the key (None)."""
    if key not in KEYS:
        raise ConfigError(f"unknown table service setting {key!r}; known: {', '.join(KEYS)}")
    word = text.strip().lower()
    if word == "default":
        return None
    kind = type(getattr(ServiceSettings(), key))
    try:
        if kind is bool:
            if word not in _TRUE | _FALSE:
                raise ValueError(text)
            return word in _TRUE
        return kind(word)
    except ValueError as exc:
        raise ConfigError(
            f"table service setting {key}={text!r} is not a {kind.__name__} "
            f"({'true/false' if kind is bool else 'a number'}, or 'default')"
        ) from exc


def parse_settings(raw: bytes, where: str, replacing: frozenset[str] = frozenset()) -> ServiceSettings:
    """services.json parsed strictly: `{"format": 1, "settings": {key: value}}`, else a CorruptFileError naming the
    key, the file and the command that fixes it. `replacing`: keys a change is about to set or reset, whose stored
    values are not read (so `dbidx config URI KEY=default` repairs a bad value of KEY)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptFileError(
            f"table service settings {where} are not valid JSON: {exc}; delete the file to go back to the defaults "
            "(then `dbidx config URI KEY=VALUE` sets what you need)"
        ) from exc
    if not isinstance(data, dict) or set(data) != {"format", "settings"} or not isinstance(data["settings"], dict):
        raise CorruptFileError(
            f"table service settings {where} must be an object with exactly 'format' and "
            f"'settings' (an object), got {str(data)[:200]}"
        )
    if data["format"] != SERVICES_FORMAT or isinstance(data["format"], bool):
        raise CorruptFileError(
            f"table service settings {where} have format {data['format']!r}; this dbidx reads format {SERVICES_FORMAT}"
        )
    values: dict[str, Any] = {}
    for key, value in data["settings"].items():
        if key in replacing:
            continue
        fix = f"; fix it with `dbidx config URI {key}=default` (or {key}=VALUE)"
        if key not in KEYS:
            raise CorruptFileError(f"table service settings {where}: unknown key {key!r}{fix}")
        try:
            values[key] = check_value(key, value)
        except ValueError as exc:
            raise CorruptFileError(f"table service settings {where}: {exc}{fix}") from exc
    return ServiceSettings(**values)


def settings_json(settings: ServiceSettings) -> bytes:
    """services.json's bytes: the keys that differ from their defaults, sorted."""
    return json.dumps({"format": SERVICES_FORMAT, "settings": settings.changed()}, indent=2, sort_keys=True).encode()


def read_settings(io: FileIO) -> ServiceSettings:
    """The table's settings (the defaults when the file does not exist)."""
    if not io.exists(SERVICES_FILE):
        return ServiceSettings()
    return parse_settings(io.read_bytes(SERVICES_FILE), io.path(SERVICES_FILE))


def write_settings(io: FileIO, changes: Mapping[str, Any]) -> ServiceSettings:
    """Change some keys and write the file atomically (read, change, replace: two concurrent `config` calls keep
    the last one's whole file). Returns the settings now in force."""
    current = ServiceSettings()
    if io.exists(SERVICES_FILE):  # the keys being changed are not read: a bad value of one is repaired here
        current = parse_settings(io.read_bytes(SERVICES_FILE), io.path(SERVICES_FILE), frozenset(changes))
    settings = with_changes(current, changes)
    io.write_atomic(SERVICES_FILE, settings_json(settings))
    return settings
