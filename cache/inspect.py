"""Operator views of caches on disk: find them under a base path, open one by path, report its state."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.data.key_files import KEY_FILES_DIR, finished_files
from dbidx.errors import CacheError


def is_cache_dir(path: Path) -> bool:
    """Whether a directory is one shard's RocksDB cache."""
    return (path / "CURRENT").is_file() and path.name.startswith("shard-")


def find_cache_dirs(path: str | Path) -> list[Path]:
    """A shard cache directory itself, or every shard cache under a base path (<base>/<table dir>/shard-*)."""
    root = Path(path)
    if not root.is_dir():
        raise CacheError(f"cache directory {root} does not exist")
    if is_cache_dir(root):
        return [root]
    found = sorted(p for p in root.glob("shard-*") if is_cache_dir(p))
    found += sorted(p for p in root.glob("*/shard-*") if is_cache_dir(p))
    if not found:
        raise CacheError(
            f"no dbidx cache under {root}: expected <base>/<table id>-<location hash>/shard-NNNNN-of-NNNNN directories"
        )
    return found


def open_cache_dir(path: str | Path, config: CacheConfig | None = None) -> RecordIndexCache:
    """Open an existing shard cache by path alone (its identity comes from its registry)."""
    path = Path(path)
    if not is_cache_dir(path):
        raise CacheError(f"{path} is not a dbidx shard cache directory (no RocksDB CURRENT file)")
    return RecordIndexCache(path, None, config).open()


def _iso(ms: int) -> str | None:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds") if ms else None


def cache_report(cache: RecordIndexCache) -> dict[str, Any]:
    """Identity, watermark, disk use and per-partition state of one open cache, as plain data."""
    ident = cache.identity
    assert ident is not None
    partitions: list[dict[str, Any]] = []
    for name, state in sorted(cache.partitions().items()):
        partitions.append(
            {
                "partition": name,
                "state": state.state,
                "entries": state.entries,
                "disk_bytes": cache.disk_bytes(name),
                "loaded_seq": state.loaded_seq,
                "synced_seq": state.synced_seq,
                "last_access": _iso(state.last_access_ms),
                "loaded_at": _iso(state.loaded_at_ms),
                "file_groups": len(state.fills),
            }
        )
    entries = sum(p["entries"] for p in partitions)
    disk = cache.disk_bytes()
    return {
        "path": str(cache.path),
        "table_id": ident.table_id,
        "shard": ident.shard,
        "num_shards": ident.num_shards,
        "index_mode": ident.index_mode,
        "watermark": cache.watermark,
        "recovered": cache.recovered,
        "entries": entries,
        "disk_bytes": disk,
        "bytes_per_entry": round(disk / entries, 2) if entries else None,
        "partitions": partitions,
    }


def caches_summary(config: CacheConfig | None = None) -> dict[str, Any]:
    """Where caches live by default and what is there, without opening any (what `dbidx cache info` prints): the
    base path, the rule that chose it, each shard cache under it with its bytes on disk, and each table's key files
    (data/key_files.py: count and bytes)."""
    from dbidx.cache.base_dir import base_path_choice
    from dbidx.config import PREFIX

    if config is not None and config.base_path:
        base, chosen_by = Path(config.base_path), f"{PREFIX}base.path (DBIDX_CACHE_BASE_PATH)"
    else:
        base, chosen_by = base_path_choice()
    found = sorted(p for p in base.glob("*/shard-*") if is_cache_dir(p)) if base.is_dir() else []
    caches = [{"path": str(p), "disk_bytes": sum(f.stat().st_size for f in p.rglob("*") if f.is_file())} for p in found]
    key_dirs = sorted(p for p in base.glob(f"*/{KEY_FILES_DIR}") if p.is_dir()) if base.is_dir() else []
    key_files = [
        {"path": str(p), "files": len(files), "disk_bytes": sum(size for _m, size, _p in files)}
        for p in key_dirs
        for files in [finished_files(p)]
    ]
    return {
        "base_path": str(base),
        "chosen_by": chosen_by,
        "exists": base.is_dir(),
        "caches": caches,
        "disk_bytes": sum(c["disk_bytes"] for c in caches),
        "key_files": key_files,
    }
