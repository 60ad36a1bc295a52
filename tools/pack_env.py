"""Build the packed virtualenv that ships dbidx to Spark executors (`spark.archives=dbidx-env.tar.gz#env`).

Why a packed environment: dbidx needs compiled extensions on every executor (rocksdict's RocksDB, pyarrow, xxhash,
msgpack), and PySpark's `spark.submit.pyFiles` / `addPyFile` only put `.zip`, `.egg` and `.jar` files on the
workers' path, so a wheel shipped that way is never imported. A venv holding dbidx and its runtime dependencies,
packed with venv-pack and unpacked by Spark in each executor's working directory, is.

pyspark itself is left out: the cluster's Spark puts its own pyspark (matching its JVM) on the Python workers'
path, and a second copy of pyspark in the env could disagree with it. Nothing here imports pyspark.

Usage: `python tools/pack_env.py --out dist/dbidx-env.tar.gz [--extra object-store]`
(or `make pack-env`). The archive's `bin/python` links to the interpreter the venv was made from, so every node
needs that same Python at the same path (docs/DEPLOY.md).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
SUPPLIED_BY_SPARK = {"pyspark"}
# Not part of the package: virtualenvs, build output, caches, VCS data.
NOT_SOURCES = (
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "demo-output",
    "*.tar.gz",
)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass
class PackResult:
    """What pack_env built: the archive, its size, how long it took and what went into the env."""

    path: str
    bytes: int
    seconds: float
    requirements: list[str]
    step_seconds: dict[str, float]


def runtime_requirements(pyproject: Path, extras: Sequence[str] = ()) -> list[str]:
    """dbidx's runtime dependencies (plus the named extras') from pyproject.toml, without what Spark supplies."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"unknown extra {extra!r}; pyproject.toml defines {sorted(optional)}")
        wanted += optional[extra]
    kept = []
    for requirement in wanted:
        match = _NAME.match(requirement)
        name = match.group(1).lower().replace("_", "-") if match else ""
        if name not in SUPPLIED_BY_SPARK and requirement not in kept:
            kept.append(requirement)
    return kept


def copy_sources(repo: str | Path, dest: Path) -> Path:
    """The repository's files without virtualenvs, build output, caches or VCS data: what the wheel is built from."""
    shutil.copytree(repo, dest, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    return dest


def _run(command: list[str]) -> None:
    """Run a build step; on failure raise with its output (pip's reason is the useful part)."""
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed with exit code {done.returncode}:\n{done.stdout[-3000:]}")


def pack_env(
    out_path: str | Path, python: str = sys.executable, extras: Sequence[str] = (), repo: str | Path = REPO_ROOT
) -> PackResult:
    """Create a fresh venv with a non-editable dbidx and its runtime deps (no pyspark) and pack it to out_path.

    python: the interpreter the venv is made from (executors run it, so use the Python the nodes have).
    """
    try:
        import venv_pack
    except ImportError as exc:
        raise RuntimeError("packing needs venv-pack: pip install 'venv-pack>=0.2,<0.3' (in dbidx's dev extra)") from exc
    started = time.perf_counter()
    out = Path(out_path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    requirements = runtime_requirements(Path(repo) / "pyproject.toml", extras)
    steps: dict[str, float] = {}

    def step(name: str, command: list[str]) -> None:
        begun = time.perf_counter()
        _run(command)
        steps[name] = round(time.perf_counter() - begun, 1)

    with tempfile.TemporaryDirectory(prefix="dbidx-pack-") as tmp:
        env = Path(tmp) / "env"
        env_python = str(env / "bin" / "python")
        # 1. A fresh venv: nothing of the build machine's site-packages leaks in.
        step("venv", [python, "-m", "venv", str(env)])
        # 2. dbidx itself, built from a clean copy of the sources as a regular (non-editable) install, without its
        #    deps: an editable install would point back into the repository, which executors do not have, and a build
        #    in the repository would reuse its setuptools `build/` directory, stale files included.
        source = copy_sources(repo, Path(tmp) / "src")
        step(
            "dbidx",
            [env_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", str(source)],
        )
        # 3. Its runtime dependencies except pyspark, which the cluster's Spark supplies.
        step(
            "dependencies",
            [env_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements],
        )
        # 4. The check that matters on an executor: everything imports with the env's own interpreter.
        step("import check", [env_python, "-c", "import dbidx.spark_integration.task, rocksdict, pyarrow, pandas"])
        # 5. Pack: venv-pack rewrites the activation scripts and shebangs to be relative to where it is unpacked.
        out.unlink(missing_ok=True)
        begun = time.perf_counter()
        venv_pack.pack(prefix=str(env), output=str(out), verbose=False)
        steps["pack"] = round(time.perf_counter() - begun, 1)
    return PackResult(str(out), out.stat().st_size, round(time.perf_counter() - started, 1), requirements, steps)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: pack the env and print what was built as JSON."""
    parser = argparse.ArgumentParser(description="Pack a venv with dbidx (without pyspark) for spark.archives.")
    parser.add_argument("--out", default="dist/dbidx-env.tar.gz", help="archive to write [dist/dbidx-env.tar.gz]")
    parser.add_argument("--python", default=sys.executable, help="interpreter to build the venv from [this one]")
    parser.add_argument(
        "--extra", action="append", default=[], help="an extra of dbidx to include, e.g. object-store (repeatable)"
    )
    args = parser.parse_args(argv)
    result = pack_env(args.out, python=args.python, extras=args.extra)
    print(json.dumps(asdict(result), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
