"""The front door: `from dbidx import Table, upsert, ...` gives the library's own objects, imported on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import version

import pytest

import dbidx

NAMES = {
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


def test_every_name_is_the_object_its_module_defines() -> None:
    assert set(dbidx.__all__) == set(NAMES) | {"__version__"}
    for name, module in NAMES.items():
        assert getattr(dbidx, name) is getattr(importlib.import_module(module), name), name
    assert set(NAMES) <= set(dir(dbidx))
    namespace: dict[str, object] = {}
    exec("from dbidx import *", namespace)
    assert namespace["Table"] is dbidx.Table and namespace["__version__"] == dbidx.__version__


def test_version_is_the_installed_one() -> None:
    assert dbidx.__version__ == version("dbidx")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Tabel'"):
        dbidx.Tabel
    with pytest.raises(ImportError):
        exec("from dbidx import Tabel", {})


def test_importing_dbidx_loads_neither_pyspark_nor_the_library() -> None:
    """A fresh interpreter: `import dbidx` imports no Spark and no library module; the first use imports the one it
    needs, and a Spark function's module still leaves pyspark alone until it is called."""
    code = (
        "import sys, dbidx\n"
        "print(sorted(m for m in sys.modules if m.startswith(('pyspark', 'dbidx.'))))\n"
        "dbidx.upsert\n"
        "print('pyspark' in sys.modules, 'dbidx.spark_integration.api' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "['dbidx.moved', 'dbidx.version']", out
    assert out[1] == "False True", out


@pytest.mark.parametrize(
    "module",
    [
        "dbidx.table.facade",
        "dbidx.spark_integration.api",
        "dbidx.spark_integration.local",
        "dbidx.spark_integration.reads",
        "dbidx.data.reads",
        "dbidx.config",
        "dbidx.errors",
        "dbidx.buckets.assigner",
    ],
)
def test_user_facing_modules_say_what_they_export(module: str) -> None:
    """`__all__` on each module the front door reads from: every name exists, and the front door's own names from
    that module are among them."""
    loaded = importlib.import_module(module)
    assert loaded.__all__ and all(hasattr(loaded, name) for name in loaded.__all__), module
    assert {n for n, m in NAMES.items() if m == module} <= set(loaded.__all__)


def test_a_moved_module_path_still_imports_the_module_it_became() -> None:
    """0.2 renamed the rooms (mdt/ -> index/ and table/, table/ -> storage/); the old paths resolve, for one release,
    to the very module objects (no copies), with a DeprecationWarning naming the new path."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import dbidx\n"
        "try:\n"
        "    from dbidx.mdt.table import Table\n"
        "except DeprecationWarning as w:\n"
        "    print(w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from dbidx.mdt.table import Table\n"
        "from dbidx.table.fileio import FileIO\n"
        "import dbidx.mdt.rli_files as old, dbidx.index.rli_files as new\n"
        "from dbidx.table import timeline\n"
        "import dbidx.storage.fileio, dbidx.storage.timeline, dbidx.table.facade\n"
        "print(Table is dbidx.table.facade.Table, FileIO is dbidx.storage.fileio.FileIO, old is new,\n"
        "      timeline is dbidx.storage.timeline)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [
        "dbidx.mdt.table moved to dbidx.table.facade in dbidx 0.2; import it from there (the old path "
        "goes in the next release)",
        "True True True True",
    ], out


def test_every_moved_path_names_a_module_that_exists() -> None:
    from dbidx.moved import MOVED

    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, (old, new)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dbidx.mdt.no_such_module")
