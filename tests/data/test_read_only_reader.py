"""A reader without write access to the table (issue 63 item 5): once another engine committed, a read must absorb
its versions, which writes to `.dbidx/`. Such a reader gets a typed error naming the versions and `dbidx sync`
(exit 3), never a bare PermissionError; after a writer's `dbidx sync` it reads again. The reader runs as another
user (root's own permission checks would let it write) or, when the tests do not run as root, over a folder made
read-only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from deltalake import write_deltalake

from tests.data.test_foreign_writers import Writer, arrow

NOBODY = 65534
READ = "import sys; from dbidx import read_arrow; from dbidx.table.facade import Table; " + (
    "print(read_arrow(Table.open(sys.argv[1])).num_rows)"
)
CLI = "import sys; from dbidx.cli import main; sys.argv[0] = 'dbidx'; main()"


def _as_reader(args: list[str]) -> subprocess.CompletedProcess:
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    return subprocess.run(prefix + [sys.executable, *args], capture_output=True, text=True, cwd="/", timeout=120)


@pytest.fixture
def shared_dir():
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no way to read as another user")
    root = tempfile.mkdtemp(prefix="dbidx-ro-", dir="/tmp")  # tmp_path's parents are private to this user
    os.chmod(root, 0o755)
    yield Path(root)
    subprocess.run(["chmod", "-R", "u+w", root], check=False)
    shutil.rmtree(root, ignore_errors=True)


def _readable_only(path: str) -> None:
    subprocess.run(["chmod", "-R", "a+rX", path], check=True)
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", os.path.join(path, ".dbidx")], check=True)


@pytest.mark.slow
def test_a_reader_without_write_access_gets_a_typed_error_then_reads_after_a_sync(shared_dir: Path) -> None:
    w = Writer(shared_dir)
    _readable_only(w.path)
    assert _as_reader(["-c", READ, w.path]).stdout.strip() == str(len(w.model))  # nothing to absorb: reads
    write_deltalake(w.path, arrow([("z1", "d1", 1)]), partition_by=["dt"], mode="append")
    w.model[("d1", "z1")] = 1
    _readable_only(w.path)
    before = sorted(str(p) for p in Path(w.path, ".dbidx").rglob("*"))
    read = _as_reader(["-c", READ, w.path])
    assert read.returncode != 0 and "ReadOnlyTableError" in read.stderr and "dbidx sync" in read.stderr, read.stderr
    for command in (["stats", w.path], ["verify", w.path], ["lookup", w.path, "k1", "--partition", "dt=d2"]):
        result = _as_reader(["-c", CLI, *command])
        assert result.returncode == 3, (command, result.stdout, result.stderr)
        assert "dbidx sync" in result.stderr and "Traceback" not in result.stderr, (command, result.stderr)
    assert sorted(str(p) for p in Path(w.path, ".dbidx").rglob("*")) == before  # nothing written
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "u+w", os.path.join(w.path, ".dbidx")], check=True)
    sync = subprocess.run([sys.executable, "-c", CLI, "sync", w.path], capture_output=True, text=True)
    assert sync.returncode == 0, sync.stderr
    _readable_only(w.path)
    assert _as_reader(["-c", READ, w.path]).stdout.strip() == str(len(w.model))
    w.check()
