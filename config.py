"""Cache configuration: RFC-107's keys plus dbidx's own, read from a dict, environment variables or a Spark conf.

Every key lives under `hoodie.index.cache.rocksdb.` (RFC-107's prefix, so one Hudi-style config block configures
dbidx too). Environment variables use `DBIDX_CACHE_` + the suffix upper-cased with dots as underscores, e.g.
`DBIDX_CACHE_BLOCK_CACHE_MB=256`. Precedence: explicit mapping > Spark conf > environment > default.
Defaults and the reasons for them are in docs/CONFIG.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Mapping, get_args, get_origin, get_type_hints

from dbidx.errors import ConfigError

__all__ = ["CacheConfig"]

PREFIX = "hoodie.index.cache.rocksdb."
ENV_PREFIX = "DBIDX_CACHE_"
# RFC-107's on/off switch. Not a setting here: the cache is how dbidx tags, so `true` (a Hudi-style config block
# copied as it is) is accepted and changes nothing, and `false` is refused rather than ignored.
SWITCH = "enabled"
Compression = Literal["zstd", "lz4", "snappy", "none"]
CompactionStyle = Literal["level", "universal"]
COMPRESSIONS = get_args(Compression)
COMPACTION_STYLES = get_args(CompactionStyle)


@dataclass(frozen=True)
class CacheConfig:
    """Settings of the executor-local cache (one value per RFC-107 / dbidx key)."""

    base_path: str | None = None  # None: base_path_choice (the node's Spark local dir, else the user cache dir)
    bootstrap_days: int = 7
    partition_ttl_hours: float = 72.0
    block_cache_mb: int = 256  # per Python worker process, shared by the shards it opens (cache/store.py)
    compaction_style: CompactionStyle = "level"
    compression: Compression = "zstd"
    block_size_kb: int = 16
    bloom_bits_per_key: float = 10.0
    max_open_files: int = 256
    max_disk_mb: int = 0  # 0: no disk budget, TTL only
    max_catchup_entries: int = 2_000_000
    load_threads: int = 0  # on-demand partition loads at once per open cache; 0: one per core, at most 8
    lock_timeout_s: float = 600.0
    reaper_interval_s: float = 300.0
    stage_loads: bool = True  # a bulk load's tasks stage their entries for the caches: no cold first batch after it
    key_files_mb: int = 4096  # per table and executor: data files' key indexes on local disk (data/key_files.py)
    service: bool = False  # upsert tasks hand their shard's work to a per-node cache service (spark_integration/)
    service_idle_s: float = 300.0  # a cache service exits after this long without a request

    @property
    def on_demand_workers(self) -> int:
        """Concurrent on-demand loads per open cache. Why not more by default: each load holds its partition's
        snapshot and SST build in memory, and on a core already busy a second thread adds memory, not speed (at
        100 M keys, 8 loads of 1.7 M-entry partitions peaked at ~4 GB in one worker)."""
        return self.load_threads or max(1, min(8, os.cpu_count() or 1))

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Config key (with prefix) -> field name."""
        return {PREFIX + f.name.replace("_", "."): f.name for f in fields(cls)}

    @classmethod
    def field_for(cls, key: str) -> str:
        """The field a key names, in any documented form: full (`hoodie.index.cache.rocksdb.base.path`), short
        dotted (`base.path`) or field name (`base_path`); ConfigError listing the forms otherwise."""
        names = {f.name for f in fields(cls)}
        short = key.removeprefix(PREFIX)
        name = short.replace(".", "_")
        if name in names and (short == name or short == name.replace("_", ".")):
            return name
        raise ConfigError(
            f"unknown cache config key {key!r}: give a key as the full name "
            f"({PREFIX}base.path), the short dotted name (base.path) or the field name (base_path); "
            f"known short names: {', '.join(sorted(k[len(PREFIX) :] for k in cls.keys()))}"
        )

    @classmethod
    def from_sources(
        cls,
        mapping: Mapping[str, Any] | None = None,
        spark_conf: Any = None,
        environ: Mapping[str, str] | None = None,
    ) -> "CacheConfig":
        """Merge the sources (mapping > Spark conf > environment) over the defaults, validating every value."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        seen: dict[str, str] = {}
        switch: tuple[Any, str] | None = None  # RFC-107's switch, by the same precedence as the settings
        if ENV_PREFIX + SWITCH.upper() in env:
            switch = (env[ENV_PREFIX + SWITCH.upper()], ENV_PREFIX + SWITCH.upper())
        if spark_conf is not None and spark_conf.get(PREFIX + SWITCH, None) is not None:
            switch = (spark_conf.get(PREFIX + SWITCH, None), f"Spark conf {PREFIX}{SWITCH}")
        for key, name in cls.keys().items():
            env_name = ENV_PREFIX + key[len(PREFIX) :].replace(".", "_").upper()
            if env_name in env:
                values[name] = (env[env_name], env_name)
        if spark_conf is not None:
            for key, name in cls.keys().items():
                value = spark_conf.get(key, None)
                if value is not None:
                    values[name] = (value, f"Spark conf {key}")
        for key, value in (mapping or {}).items():
            if key in (SWITCH, PREFIX + SWITCH):
                switch = (value, f"key {key}")
                continue
            name = cls.field_for(key)
            if name in seen:
                raise ConfigError(
                    f"cache config keys {seen[name]!r} and {key!r} set the same setting {name}; give it once"
                )
            seen[name] = key
            values[name] = (value, f"key {key}")
        if switch is not None:
            _check_switch(*switch)
        return replace(cls(), **{n: _coerce(n, v, where) for n, (v, where) in values.items()})

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression {self.compression!r} is not one of {COMPRESSIONS}")
        if self.compaction_style not in COMPACTION_STYLES:
            raise ConfigError(f"compaction.style {self.compaction_style!r} is not one of {COMPACTION_STYLES}")
        for name in (
            "bootstrap_days",
            "block_cache_mb",
            "block_size_kb",
            "max_open_files",
            "max_disk_mb",
            "max_catchup_entries",
            "load_threads",
            "key_files_mb",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{PREFIX}{name.replace('_', '.')} must be >= 0, got {getattr(self, name)}")
        if self.service_idle_s <= 0:
            raise ConfigError(f"{PREFIX}service.idle.s must be > 0, got {self.service_idle_s}")
        if self.partition_ttl_hours <= 0:
            raise ConfigError(f"{PREFIX}partition.ttl.hours must be > 0, got {self.partition_ttl_hours}")


def _check_switch(value: Any, where: str) -> None:
    """RFC-107's `enabled`: true passes, false is a ConfigError (see SWITCH)."""
    if not _read_bool(value, where, SWITCH):
        raise ConfigError(
            f"{PREFIX}{SWITCH}=false ({where}): dbidx has no cache-less tagging path, so it refuses the "
            "setting rather than ignore it; remove the key (true is accepted for Hudi-style config "
            "blocks) or tag this table with another index"
        )


def _read_bool(value: Any, where: str, name: str) -> bool:
    if isinstance(value, str):
        if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{where}: cannot read {value!r} as bool for {name}")
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _coerce(name: str, value: Any, where: str) -> Any:
    """Convert a config value (often a string from the environment or a Spark conf) to the field's declared type,
    naming the source on failure. The dataclass's annotations are the one source of the types."""
    kind = get_type_hints(CacheConfig)[name]
    try:
        if kind is bool:
            return _read_bool(value, where, name)
        if kind is int or kind is float:
            return kind(value)
        if get_origin(kind) is Literal:  # an enumeration: case-insensitive, one of its values
            text = str(value).strip().lower()
            if text not in get_args(kind):
                raise ValueError(f"not one of {', '.join(get_args(kind))}")
            return text
        if kind == (str | None):
            return None if value in (None, "") else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read {value!r} as {_type_name(kind)} for {name} ({exc})") from exc
    raise ConfigError(f"{where}: config field {name} has a type ({kind}) with no reader")


def _type_name(kind: Any) -> str:
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(get_args(kind))
    return getattr(kind, "__name__", str(kind))
