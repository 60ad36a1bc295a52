"""What `make pack-env` puts into the shipped virtualenv (the build itself runs in
tests/spark_integration/test_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.pack_env import REPO_ROOT, copy_sources, runtime_requirements


def names(requirements: list[str]) -> list[str]:
    return [r.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip() for r in requirements]


def test_runtime_requirements_leave_pyspark_to_the_cluster() -> None:
    wanted = names(runtime_requirements(REPO_ROOT / "pyproject.toml"))
    assert "pyspark" not in wanted
    assert {"rocksdict", "pyarrow", "numpy", "msgpack", "xxhash", "pandas"} <= set(wanted)
    assert "pytest" not in wanted  # the dev extra stays out


def test_extras_are_added_and_an_unknown_one_is_named(tmp_path: Path) -> None:
    with_store = names(runtime_requirements(REPO_ROOT / "pyproject.toml", ["object-store"]))
    assert "obstore" in with_store and "pyspark" not in with_store
    with pytest.raises(ValueError, match="unknown extra 'nope'"):
        runtime_requirements(REPO_ROOT / "pyproject.toml", ["nope"])


def test_the_sources_copied_for_the_build_leave_out_venvs_and_build_output(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for rel in (
        "pyproject.toml",
        "__init__.py",
        "cache/store.py",
        ".venv/bin/python",
        "build/lib/dbidx/stale.py",
        "dist/dbidx-env.tar.gz",
        "dbidx.egg-info/PKG-INFO",
        "cache/__pycache__/store.cpython-311.pyc",
    ):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("x")
    copy = copy_sources(repo, tmp_path / "copy")
    copied = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert copied == ["__init__.py", "cache/store.py", "pyproject.toml"]
