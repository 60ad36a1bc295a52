"""dbidx: an executor-local RocksDB record-index cache for PySpark upserts over a persisted record-level index.

The front door: `from dbidx import Table, upsert, read_table, ...` (README "Use"). Each name is imported on first
use (PEP 562), so `import dbidx` stays light, a CLI command or a Spark worker loads only what it runs, and pyspark is
imported only by the Spark functions when they are called.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from dbidx import moved as _moved
from dbidx.version import __version__

_moved.install()  # module paths that moved in 0.2 stay importable for one release (moved.py)

# Public name -> the module that defines it.
_EXPORTS = {
    "Table": "dbidx.table.facade",
    "upsert": "dbidx.spark_integration.api",
    "tag": "dbidx.spark_integration.api",
    "bulk_insert": "dbidx.spark_integration.api",
    "upsert_arrow": "dbidx.spark_integration.local",
    "read_table": "dbidx.spark_integration.reads",
    "read_arrow": "dbidx.data.reads",
    "BucketSpec": "dbidx.buckets.assigner",
    "CacheConfig": "dbidx.config",
    "DbidxError": "dbidx.errors",
}

__all__ = [
    "BucketSpec",
    "CacheConfig",
    "DbidxError",
    "Table",
    "__version__",
    "bulk_insert",
    "read_arrow",
    "read_table",
    "tag",
    "upsert",
    "upsert_arrow",
]  # the names of _EXPORTS (tests/test_front_door.py)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from dbidx.buckets.assigner import BucketSpec
    from dbidx.config import CacheConfig
    from dbidx.data.reads import read_arrow
    from dbidx.errors import DbidxError
    from dbidx.spark_integration.api import bulk_insert, tag, upsert
    from dbidx.spark_integration.local import upsert_arrow
    from dbidx.spark_integration.reads import read_table
    from dbidx.table.facade import Table


def __getattr__(name: str) -> Any:
    """Import a front-door name on first use and keep it in the package's namespace."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dbidx' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
