"""The package's shape holds: its floors import one way, no module imports itself back through others (lazy and
type-checking imports included: they hide a circle, they do not break it), and only the Spark glue imports pyspark.

Read from the sources with `ast`, so a violation fails here with the import that breaks the rule, not later as an
import-order accident. docs/DESIGN.md section 7 describes the floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a module may import its own package and any lower floor, never a higher one. Modules that share a
# floor without being one package (the base modules, the CLI's) may import each other; the circle check covers them.
FLOORS = {
    # The package itself is the front door (`from dbidx import Table, upsert, ...`): it sits above every floor.
    "dbidx": 10,
    "dbidx.version": 0,
    "dbidx.errors": 0,
    "dbidx.config": 0,
    "dbidx.counters": 0,
    "dbidx.progress": 0,
    "dbidx.charts": 0,
    "dbidx.arrays": 0,
    "dbidx.runner": 0,
    "dbidx.plain": 0,
    "dbidx.lru": 0,
    "dbidx.moved": 0,
    "dbidx.storage": 1,
    "dbidx.data": 2,
    "dbidx.index": 3,
    "dbidx.table": 4,
    "dbidx.buckets": 5,
    "dbidx.cache": 6,
    "dbidx.bootstrap": 7,
    "dbidx.spark_integration": 8,
    "dbidx.cli": 9,
    "dbidx.cli_cache": 9,
    "dbidx.cli_services": 9,
    "dbidx.cli_output": 9,
    "dbidx.cli_table": 9,
    "dbidx.demo": 9,
}
NOT_PACKAGED = {"tests", "benchmarks", "tools", "docs", ".venv", "build", "dist", ".git"}


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGED or rel.parts[0].endswith(".egg-info"):
            continue
        name = ".".join(("dbidx",) + rel.with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every dbidx module `path` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def floor_of(module: str) -> tuple[str, int]:
    for prefix in sorted(FLOORS, key=len, reverse=True):
        if module == prefix or (prefix != "dbidx" and module.startswith(prefix + ".")):
            return prefix, FLOORS[prefix]
    raise AssertionError(f"{module} has no floor in tests/test_layering.py FLOORS: place it there")


def test_floors_import_one_way() -> None:
    known = modules()
    wrong = []
    for name, path in sorted(known.items()):
        own, level = floor_of(name)
        for target in sorted(imports_of(name, path, known)):
            other, other_level = floor_of(target)
            if other_level > level:
                wrong.append(f"{name} imports {target} ({other}, floor {other_level} above {own}'s {level})")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_back() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)


def test_only_the_spark_glue_imports_pyspark() -> None:
    found = []
    for name, path in sorted(modules().items()):
        if name.startswith("dbidx.spark_integration"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{name}: {n}" for n in names if n.split(".")[0] == "pyspark"]
    assert not found, "\n".join(found)


def test_the_rules_see_the_package() -> None:
    """The checks above read real modules with real imports (so an empty walk cannot pass them)."""
    known = modules()
    assert {
        "dbidx.storage.timeline",
        "dbidx.data.reads",
        "dbidx.table.facade",
        "dbidx.cache.record_cache",
        "dbidx.spark_integration.api",
        "dbidx.cli",
    } <= set(known)
    assert "dbidx.storage.timeline" in imports_of("dbidx.table.facade", known["dbidx.table.facade"], known)
