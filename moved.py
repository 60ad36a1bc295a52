"""Module paths that moved, kept importable for one release with a DeprecationWarning that names the new path.

Why: user code and notebooks import deep paths (`from dbidx.mdt.table import Table` was the README's own example).
The 0.2 layout names rooms for what they hold (`storage/`, `index/`, `table/`; docs/DESIGN.md "Layering"), and a
renamed module must not break such code on upgrade. The old name resolves to the new module object itself, so
`isinstance`, monkeypatching and pickles by reference see one module, not a copy. `dbidx/__init__.py` installs the
finder; it answers only for the names in `MOVED`, after every other finder has failed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Sequence

_STORAGE = (
    "archive_retention",
    "checkpoint",
    "commit_lock",
    "data_view",
    "fileio",
    "format_switch",
    "heartbeat",
    "history_floor",
    "instant_range",
    "keyhash",
    "keys",
    "layout",
    "leftovers",
    "markers",
    "object_store",
    "pending",
    "properties",
    "records",
    "state",
    "timeline",
    "writer_presence",
)
_TABLE = (
    "absorb",
    "build_index",
    "delta_properties",
    "readopt",
    "service_settings",
    "services",
    "upgrade",
    "vacuum",
    "verify_table",
    "writer",
)

# Old module path -> new module path (dbidx 0.2; the old paths go in the release after it).
MOVED: dict[str, str] = {
    **{f"dbidx.table.{name}": f"dbidx.storage.{name}" for name in _STORAGE},
    "dbidx.table.file_view": "dbidx.storage.index_view",
    **{f"dbidx.mdt.{name}": f"dbidx.index.{name}" for name in ("rli_files", "conflicts", "point_lookup", "compaction")},
    **{f"dbidx.mdt.{name}": f"dbidx.table.{name}" for name in _TABLE},
    "dbidx.mdt.table": "dbidx.table.facade",
    "dbidx.mdt.table_reads": "dbidx.table.index_reads",
    "dbidx.mdt.table_delta": "dbidx.table.delta_sync",
}
# Old packages that no longer exist as folders: an empty namespace under which the moved names resolve.
OLD_PACKAGES = ("dbidx.mdt",)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module object (or, for an old package, an empty package)."""

    def __init__(self, new: str | None) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.new is None:
            package = types.ModuleType(spec.name, f"Moved in dbidx 0.2: see {__name__}.MOVED.")
            package.__path__ = []
            return package
        warnings.warn(
            f"{spec.name} moved to {self.new} in dbidx 0.2; import it from there (the old path goes in "
            "the next release)",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new module is already imported."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old path of a moved module (and only those), last on sys.meta_path."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[fullname]))
        if fullname in OLD_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _Alias(None), is_package=True)
        return None


def install() -> None:
    """Put the finder last on sys.meta_path, once per interpreter."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
