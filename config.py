"""Cache configuration: RFC-107's keys plus dbidx's own, read from a dict, environment variables or a Spark conf.

Every key lives under `hoodie.index.cache.rocksdb.` (RFC-107's prefix, so one Hudi-style config block configures
dbidx too). Environment variables use `DBIDX_CACHE_` + the suffix upper-cased with dots as underscores, e.g.
`DBIDX_CACHE_BLOCK_CACHE_MB=256`. Precedence: explicit mapping > Spark conf > environment > default.
Defaults and the reasons for them are in docs/CONFIG.md.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, Mapping, get_args, get_origin, get_type_hints

from dbidx.errors import ConfigError

PREFIX = "hoodie.index.cache.rocksdb."
ENV_PREFIX = "DBIDX_CACHE_"
Compression = Literal["zstd", "lz4", "snappy", "none"]
CompactionStyle = Literal["level", "universal"]
COMPRESSIONS = get_args(Compression)
COMPACTION_STYLES = get_args(CompactionStyle)


@dataclass(frozen=True)
class CacheConfig:
    """Settings of the executor-local cache (one value per RFC-107 / dbidx key)."""

    enabled: bool = True
    base_path: str | None = None  # None: base_path_choice (the node's Spark local dir, else the user cache dir)
    bootstrap_days: int = 7
    partition_ttl_hours: float = 72.0
    block_cache_mb: int = 64
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
        raise ConfigError(f"unknown cache config key {key!r}: give a key as the full name "
                          f"({PREFIX}base.path), the short dotted name (base.path) or the field name (base_path); "
                          f"known short names: {', '.join(sorted(k[len(PREFIX):] for k in cls.keys()))}")

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
        for key, name in cls.keys().items():
            env_name = ENV_PREFIX + key[len(PREFIX):].replace(".", "_").upper()
            if env_name in env:
                values[name] = (env[env_name], env_name)
        if spark_conf is not None:
            for key, name in cls.keys().items():
                value = spark_conf.get(key, None)
                if value is not None:
                    values[name] = (value, f"Spark conf {key}")
        for key, value in (mapping or {}).items():
            name = cls.field_for(key)
            if name in seen:
                raise ConfigError(f"cache config keys {seen[name]!r} and {key!r} set the same setting {name}; "
                                  "give it once")
            seen[name] = key
            values[name] = (value, f"key {key}")
        return replace(cls(), **{n: _coerce(n, v, where) for n, (v, where) in values.items()})

    def __post_init__(self) -> None:
        if not self.enabled:
            raise ConfigError(f"{PREFIX}enabled=false: dbidx has no cache-less tagging path, so it refuses the "
                              "setting rather than ignore it; remove the key (true is accepted for Hudi-style "
                              "config blocks) or tag this table with another index")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression {self.compression!r} is not one of {COMPRESSIONS}")
        if self.compaction_style not in COMPACTION_STYLES:
            raise ConfigError(f"compaction.style {self.compaction_style!r} is not one of {COMPACTION_STYLES}")
        for name in ("bootstrap_days", "block_cache_mb", "block_size_kb", "max_open_files", "max_disk_mb",
                     "max_catchup_entries", "load_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{PREFIX}{name.replace('_', '.')} must be >= 0, got {getattr(self, name)}")
        if self.partition_ttl_hours <= 0:
            raise ConfigError(f"{PREFIX}partition.ttl.hours must be > 0, got {self.partition_ttl_hours}")


def _coerce(name: str, value: Any, where: str) -> Any:
    """Convert a config value (often a string from the environment or a Spark conf) to the field's declared type,
    naming the source on failure. The dataclass's annotations are the one source of the types."""
    kind = get_type_hints(CacheConfig)[name]
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.strip().lower() in ("true", "1", "yes")
            return bool(value)
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


_SPARK_OWNED_DIR = re.compile(r"^(blockmgr|executor|spark)-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")


def node_local_root(spark_dir: str) -> Path:
    """The node's own local dir above the Spark-owned scratch directories of one executor or application.

    Why: inside a Python worker SPARK_LOCAL_DIRS is the executor's block-manager dir, e.g.
    `<local dir>/spark-<uuid>/executor-<uuid>/blockmgr-<uuid>` (standalone) or `<spark.local.dir>/spark-<uuid>/
    blockmgr-<uuid>` (local mode). Spark deletes those when the executor or application ends, so a cache under them
    would be cold in every new application; the directory above them is the disk the cluster provisions for the node
    and outlives both. Only components named like Spark's own (prefix + UUID) are stripped, and never past a mount
    point: on Kubernetes the pod's volume is mounted at `/var/data/spark-<uuid>` itself, and the directory above it
    is the container's own filesystem (small, maybe not writable), so the mount is the node's local dir there.
    """
    path = Path(spark_dir)
    while _SPARK_OWNED_DIR.match(path.name) and path.parent != path and not os.path.ismount(path):
        path = path.parent
    return path


def default_base_path(spark_local_dir: str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Where caches live when no config names a base path (`base_path_choice` tells which rule chose it)."""
    return base_path_choice(spark_local_dir, environ)[0]


def base_path_choice(spark_local_dir: str | None = None,
                     environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The default base path of the caches and the rule that chose it. One rule for Spark tasks and the CLI, so
    `dbidx cache ...` finds the caches a local job made:

    1. DBIDX_CACHE_BASE_PATH of the process (an executor's own environment);
    2. else the node's Spark local dir (SPARK_LOCAL_DIRS, else spark.local.dir; above the per-executor and
       per-application directories, see node_local_root) + /dbidx-cache, unless that local dir is the system's
       temporary directory (Spark's default, which local mode uses): then rule 3;
    3. else the user's cache dir ($XDG_CACHE_HOME/dbidx, else ~/.cache/dbidx); never a bare /tmp.

    Why: SPARK_LOCAL_DIRS is the disk the cluster manager provisions for executor scratch data (sized for it, local
    to the node); a shared /tmp is often small, tmpfs, noexec or wiped, and is where a local job and the CLI would
    otherwise disagree. Caches a dead executor left behind are removed by the abandoned-cache sweep
    (cache/reaper.py). docs/DEPLOY.md has the per-cluster-manager caveats.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV_PREFIX + "BASE_PATH"):  # set per node, e.g. spark.executorEnv.DBIDX_CACHE_BASE_PATH
        return Path(env[ENV_PREFIX + "BASE_PATH"]), f"{ENV_PREFIX}BASE_PATH"
    for candidate, name in ((env.get("SPARK_LOCAL_DIRS"), "SPARK_LOCAL_DIRS"), (spark_local_dir, "spark.local.dir")):
        first = (candidate or "").split(",")[0].strip()
        if first:
            root = node_local_root(first)
            if not _is_temp_dir(root, env):
                return root / "dbidx-cache", f"{name} ({first})"
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(xdg) / "dbidx", "the user cache dir ($XDG_CACHE_HOME/dbidx, else ~/.cache/dbidx)"


def _is_temp_dir(path: Path, env: Mapping[str, str]) -> bool:
    """Whether a directory is the system's temporary directory (/tmp, /var/tmp, $TMPDIR)."""
    temps = {"/tmp", "/var/tmp", env.get("TMPDIR") or "/tmp", tempfile.gettempdir()}
    return os.path.realpath(path) in {os.path.realpath(t) for t in temps}


def make_private_dirs(path: Path) -> None:
    """Create a directory and its missing parents, each private to the user (0700, whatever the umask); existing
    directories are left as they are (they are the user's)."""
    missing = []
    probe = Path(path)
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)


def check_private_dir(path: Path) -> None:
    """Refuse a cache directory another user owns or that group or others may write (ConfigError naming the fix).

    Why: whoever can write a directory can rename what is in it, so a base directory prepared by another user (a
    shared `/tmp` path made 0777 before our first job) would let that user swap our shard directories for theirs
    and serve us forged index entries. ssh refuses key files on the same grounds. A missing directory passes: we
    create it ourselves, 0700.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cache directory {path} cannot be inspected: {exc.strerror or exc}") from exc
    if info.st_uid != os.geteuid():
        raise ConfigError(f"cache directory {path} is owned by uid {info.st_uid}, not by this user (uid "
                          f"{os.geteuid()}): another user could replace the caches in it. Point "
                          f"{PREFIX}base.path (or DBIDX_CACHE_BASE_PATH) at a directory you own, or remove {path}")
    if info.st_mode & 0o022:
        raise ConfigError(f"cache directory {path} is writable by group or others (mode "
                          f"{oct(info.st_mode & 0o777)}): another user could replace the caches in it. Run "
                          f"`chmod go-w {path}` or point {PREFIX}base.path at a private directory")


def prepare_dir(path: Path, min_free_mb: int = 64) -> Path:
    """Create a private (0700) cache directory and check it is usable: ours alone (it and its parent, the base
    path: `check_private_dir`), writable and not full."""
    for existing in (path.parent, path):  # before creating anything inside them
        check_private_dir(existing)
    try:
        make_private_dirs(path)
    except OSError as exc:
        raise ConfigError(f"cache directory {path} cannot be created: {exc.strerror or exc}") from exc
    check_private_dir(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cache directory {path} is not writable by this user")
    free_mb = shutil.disk_usage(path).free // (1 << 20)
    if free_mb < min_free_mb:
        raise ConfigError(f"cache directory {path} has only {free_mb} MB free (need at least {min_free_mb} MB); "
                          "point hoodie.index.cache.rocksdb.base.path at a larger local disk")
    return path
