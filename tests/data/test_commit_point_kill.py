"""A writer SIGKILLed (a real kill -9 of a child process) at each step of the commit path (docs/FORMAT.md sections 12
"The commit point" and 12c): nothing is lost, nothing is published half, and every reader agrees afterwards.

The commit path of a completion: checks, the record staged (`.dbidx/timeline/staged/<instant>.json`), its Delta
version put if absent (the commit point), the record published (`.dbidx/timeline/completed/<seq>.json`), then
housekeeping. An absorption of another engine's versions writes its index files, then publishes one record per
version with `publish_exact` (a run: pass-through records, then the net record). The child dies right before or
right after one of those writes; the parent then reads the table with dbidx, deltalake, polars and DuckDB, checks
it against a model that counts the killed batch in exactly when its Delta version is on storage, verifies it, and
writes over the files the killed writer touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from dbidx.config import CacheConfig
from dbidx.data.delta_log import listed_versions, version_file
from dbidx.table.absorb import run_in_progress
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout
from dbidx.storage.records import ACTION_ROLLBACK

from tests.data.test_delta_adopt import _delete_rows, _log
from tests.delta_readers import assert_readers_agree

COLUMNS = ("id", "dt", "v")
DAYS = ("d1", "d2", "d3")
Model = dict[str, tuple[str, int]]  # id -> (dt, v); every id lives in one partition

# The child: opens the table, installs the kill, runs one write. Exit code 3: it never reached the kill point.
CHILD = textwrap.dedent("""
    import json, os, re, signal, sys
    import pyarrow as pa
    from dbidx.config import CacheConfig
    from dbidx.table.facade import Table
    from dbidx.spark_integration.local import upsert_arrow
    from dbidx.storage.fileio import FileIO
    from dbidx.storage.timeline import Timeline

    path, cache, method, pattern, when, nth, action, batch = sys.argv[1:9]
    nth, seen = int(nth), [0]

    def wrap(name):
        real = getattr(FileIO, name)

        def patched(self, rel, *args, **kwargs):
            hit = re.search(pattern, rel) is not None and name == method
            if hit:
                seen[0] += 1
            if hit and seen[0] == nth and when == "before":
                print("KILLED before", name, rel, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(self, rel, *args, **kwargs)
            if hit and seen[0] == nth and when == "after":
                print("KILLED after", name, rel, result, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(FileIO, name, patched)

    wrap("write_atomic")
    wrap("create_exclusive")
    real_start = Timeline.start

    def start(self, act, *args, **kwargs):
        started = real_start(self, act, *args, **kwargs)
        print("STARTED", act, started.instant, flush=True)
        return started

    Timeline.start = start
    table = Table.open(path)
    if action == "upsert":
        rows = json.loads(batch)
        data = pa.table({"id": [r[0] for r in rows], "dt": [r[1] for r in rows],
                         "v": pa.array([r[2] for r in rows], pa.int64()), "_dbidx_delete": [r[3] for r in rows]})
        upsert_arrow(data, table, key="id", partition="dt", cache_config=CacheConfig(base_path=cache))
    else:
        table.follow_delta_log()
    print("SURVIVED", flush=True)
    sys.exit(3)
""")

STAGED = r"^\.dbidx/timeline/staged/"
DELTA = r"^_delta_log/\d{20}\.json$"
COMPLETED = r"^\.dbidx/timeline/completed/"
LATEST = r"^\.dbidx/timeline/latest/"


@dataclass(frozen=True)
class Point:
    """Where the child dies: the `nth` call of FileIO.`method` on a path matching `pattern`, `when` it runs."""

    method: str
    pattern: str
    when: str
    action: str = "upsert"  # or "absorb": the child only reads the table, absorbing what another engine wrote
    committed: bool = True  # is the killed write's Delta version on storage (the model's independent answer)
    nth: int = 1
    foreign: tuple[str, ...] = ()  # another engine's commits, before the child runs
    foreign_after: tuple[str, ...] = ()  # and after it died, before any dbidx process looks
    first: str = "write"  # who finds the table first after the kill: a dbidx upsert, or the readers ("read")


POINTS = {
    "before-staging": Point("write_atomic", STAGED, "before", committed=False),
    "after-staging-before-delta-put": Point("write_atomic", STAGED, "after", committed=False),
    "after-delta-put-before-record": Point("create_exclusive", DELTA, "after", first="read"),
    "after-delta-put-then-another-engine-appends": Point("create_exclusive", DELTA, "after", foreign_after=("append",)),
    "after-record-before-housekeeping": Point("create_exclusive", COMPLETED, "after"),
    "after-latest-pointer": Point("create_exclusive", LATEST, "after", first="read"),
    "absorb-after-index-files-before-publish": Point(
        "create_exclusive", COMPLETED, "before", action="absorb", foreign=("append", "dv-delete")
    ),
    "absorb-after-first-run-record-before-net": Point(
        "create_exclusive", COMPLETED, "before", action="absorb", nth=2, foreign=("append", "optimize")
    ),
    "absorb-after-net-record-before-housekeeping": Point(
        "create_exclusive", COMPLETED, "after", action="absorb", foreign=("append",), first="read"
    ),
}


STAGED_BEFORE_PUT = {"after-staging-before-delta-put"}  # a staged record, no Delta version
PENDING = STAGED_BEFORE_PUT | {
    "before-staging",
    "absorb-after-index-files-before-publish",
    "absorb-after-first-run-record-before-net",
}  # the killed instant never settles


def arrow(rows: list[tuple[str, str, int, bool]]) -> pa.Table:
    return pa.table(
        {
            "id": [r[0] for r in rows],
            "dt": [r[1] for r in rows],
            "v": pa.array([r[2] for r in rows], pa.int64()),
            "_dbidx_delete": [r[3] for r in rows],
        }
    )


def apply(model: Model, rows: list[tuple[str, str, int, bool]]) -> None:
    for key, day, value, gone in rows:
        if gone:
            model.pop(key, None)
        else:
            model[key] = (day, value)


def rows_of(model: Model) -> set[tuple]:
    return {(k, d, v) for k, (d, v) in model.items()}


@dataclass
class Scene:
    path: str
    cache: str
    model: Model = field(default_factory=dict)

    def upsert(self, rows: list[tuple[str, str, int, bool]]) -> None:
        upsert_arrow(
            arrow(rows), Table.open(self.path), key="id", partition="dt", cache_config=CacheConfig(base_path=self.cache)
        )
        apply(self.model, rows)

    def staged(self) -> list[str]:
        return sorted(p.stem for p in Path(self.path, layout.STAGED_DIR).glob("*.json"))

    def dv_files(self) -> set[str]:
        return {p.name for p in Path(self.path, layout.DV_DIR).glob("*")}

    def versions(self) -> list[int]:
        return listed_versions(Table.open(self.path).io)

    def check(self) -> Table:
        """Every reader reads the model, no key twice, the table verifies, and each Delta version has its record."""
        table = Table.open(self.path)
        rows = assert_readers_agree(table, COLUMNS, rows_of(self.model))
        assert len({r[0] for r in rows}) == len(rows), "a key is live twice"
        check = verify_table(table)
        assert check.ok, check
        table.refresh()
        assert table.delta_version() == max(listed_versions(table.io)), "a Delta version without its record"
        return table


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Scene:
    """Two shards, three days; an insert, then updates and a delete (so the log has deletion vectors)."""
    base = tmp_path_factory.mktemp("template")
    scene = Scene(str(base / "t"), str(base / "cache"))
    Table.create(scene.path, num_shards=2)
    scene.upsert([(f"k{i}", DAYS[i % 3], i, False) for i in range(12)])
    scene.upsert([(f"k{i}", DAYS[i % 3], 100 + i, False) for i in range(0, 12, 2)] + [("k3", DAYS[0], 0, True)])
    return scene


def copy_scene(template: Scene, tmp_path: Path) -> Scene:
    """A copy of the template table (a cache of its own, empty: the upserts load what they need)."""
    path = tmp_path / "t"
    shutil.copytree(template.path, path, symlinks=True)
    return Scene(str(path), str(tmp_path / "cache"), dict(template.model))


def foreign_commit(scene: Scene, what: str) -> None:
    """Another engine (delta-rs) commits to the table."""
    if what == "append":
        rows = [(f"a{i}", DAYS[i % 3], 500 + i, False) for i in range(5)]
        table = arrow(rows).drop_columns(["_dbidx_delete"])
        write_deltalake(scene.path, table, partition_by=["dt"], mode="append")
        apply(scene.model, rows)
    elif what == "dv-delete":  # a DELETE by deletion vector (as Spark writes one) of the appended d1 file's 1st row
        adds = [a["add"] for a in _log(Path(scene.path)) if "add" in a]
        add = next(a for a in adds if a["path"].startswith("dt=d1/part-"))  # delta-rs names its files part-*
        first = pq.read_table(Path(scene.path, add["path"])).column("id")[0].as_py()
        _delete_rows(Path(scene.path), add, [0], inline=True)
        scene.model.pop(first)
    else:  # rewrites every small file: the index must re-point keys; the rows do not change
        DeltaTable(scene.path).optimize.compact()


@dataclass
class Child:
    """One child process, started on its own copy of the table, running until it kills itself."""

    scene: Scene
    point: Point
    before: list[int]  # the Delta versions before it ran
    dv_files: set[str]  # and dbidx's DV files
    proc: subprocess.Popen
    out: tuple[str, str] | None = None

    def lines(self) -> list[str]:
        """Wait for it; its stdout lines (it must have died of its own SIGKILL at the kill point)."""
        if self.out is None:
            self.out = self.proc.communicate(timeout=120)
        stdout, stderr = self.out
        assert self.proc.returncode == -signal.SIGKILL, (self.proc.returncode, stdout, stderr)
        lines = stdout.splitlines()
        assert lines and lines[-1].startswith("KILLED"), stdout
        return lines


def start_child(scene: Scene, point: Point) -> Child:
    for what in point.foreign:
        foreign_commit(scene, what)
    before = scene.versions()
    batch = BATCH if point.action == "upsert" else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            scene.path,
            scene.cache,
            point.method,
            point.pattern,
            point.when,
            str(point.nth),
            point.action,
            json.dumps(batch),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return Child(scene, point, before, scene.dv_files(), proc)


# Children of the tests of one kill point each (by test name): the point, and the child's key in `children`.
SWEPT = "swept"  # killed after staging: what a later write sweeps
ROLLBACK = "rollback"  # killed after its Delta put: `dbidx rollback` of its instant
SINGLE = {
    "test_a_staged_record_of_a_writer_killed_before_its_put_is_swept_by_a_later_write": SWEPT,
    "test_dbidx_rollback_of_a_writer_killed_after_its_delta_put_is_refused": ROLLBACK,
}
SINGLE_POINTS = {SWEPT: "after-staging-before-delta-put", ROLLBACK: "after-delta-put-before-record"}


@pytest.fixture(scope="module")
def children(
    template: Scene, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, Child]]:
    """The children of the selected tests, all at once (each on its own copy of the table: they are independent),
    so the module takes the time of a few."""
    here = Path(__file__).resolve()
    selected = {
        item.callspec.params["name"] if hasattr(item, "callspec") else SINGLE.get(item.name)
        for item in request.session.items
        if Path(str(item.path)).resolve() == here
    }
    runs: dict[str, Child] = {}
    try:
        for name in [n for n in [*POINTS, *SINGLE_POINTS] if n in selected]:
            point = POINTS[SINGLE_POINTS.get(name, name)]
            runs[name] = start_child(copy_scene(template, tmp_path_factory.mktemp(name)), point)
        yield runs
    finally:
        for child in runs.values():  # only a test that failed before waiting leaves one running
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.communicate(timeout=30)


def started(lines: list[str], action: str) -> list[str]:
    return [line.split()[2] for line in lines if line.startswith(f"STARTED {action} ")]


def version_instant(scene: Scene, version: int) -> str | None:
    first = json.loads(Path(scene.path, version_file(version)).read_text().splitlines()[0])
    return first["commitInfo"].get("dbidx", {}).get("instant")


# The killed batch: updates keys in every day's files, inserts two, deletes one.
BATCH = [
    ("k0", "d1", 900, False),
    ("k4", "d2", 904, False),
    ("k8", "d3", 908, False),
    ("k5", "d3", 905, False),
    ("n1", "d1", 1, False),
    ("n2", "d2", 2, False),
    ("k7", "d2", 0, True),
]


def later_write(scene: Scene, value: int) -> None:
    """A normal upsert after the kill: updates every live key (so every file the killed writer touched), inserts
    one and deletes one."""
    live = sorted(scene.model)
    rows = [(k, scene.model[k][0], value + n, False) for n, k in enumerate(live[1:])]
    rows += [("z1", "d3", value, False), (live[0], scene.model[live[0]][0], 0, True)]
    scene.upsert(rows)


def kill_and_recover(child: Child, name: str) -> tuple[Scene, list[str]]:
    """The child killed at `name`: what it left checked against the kill point, then the first dbidx process after
    it (a reader or a writer, `Point.first`) and every reader checked against the model; returns the scene and
    the instants the child started."""
    scene, point, before = child.scene, child.point, child.before
    lines = child.lines()
    after = scene.versions()
    for what in point.foreign_after:
        foreign_commit(scene, what)
    instants = started(lines, "commit" if point.action == "upsert" else "absorb")
    table = Table.open(scene.path)
    table.refresh()
    if point.action == "upsert":
        assert len(instants) == 1, lines
        killed = instants[0]
        # The model's own answer: the batch counts exactly when its Delta version is on storage.
        committed = any(version_instant(scene, v) == killed for v in set(after) - set(before))
        assert committed == point.committed, (name, before, after)
        assert set(after) - set(before) == ({max(after)} if committed else set())
        if committed:
            apply(scene.model, BATCH)
        published = table.timeline.record_of(killed)
        if name.startswith("after-delta-put"):
            assert published is None  # not yet: the next reader publishes it from the staged copy
            assert scene.staged() == [killed]
            staged = Path(scene.path, layout.staged_file(killed)).read_bytes()
        elif committed:
            assert published is not None and published.action == "commit"
        else:
            assert published is None
    else:
        assert after == before  # an absorber writes no Delta version
        assert instants, lines
        if name == "absorb-after-index-files-before-publish":
            # It wrote the index files and the DV file of its net record before it died, and published nothing.
            written = [p for p in Path(scene.path, layout.RLI_DIR).rglob("*.parquet") if instants[-1] in p.name]
            assert written, "the absorber died before writing its index files"
            assert scene.dv_files() - child.dv_files, "the absorber died before writing its DV file"
            assert all(table.timeline.record_of(i) is None for i in instants)
        elif name == "absorb-after-first-run-record-before-net":
            # The run's first record is published, its net record is not: the next reader finishes that run.
            last = table.timeline.completed()[-1]
            assert run_in_progress(last) == (before[-2], before[-1])
    if point.first == "read":
        # Right after the kill: every reader agrees on the model (dbidx's read publishes or absorbs what is missing).
        table = scene.check()
    else:
        # The next dbidx writer finds the table first (it publishes or absorbs what is missing before it starts).
        later_write(scene, 2000)
        table = scene.check()
    if point.action == "upsert" and point.committed:
        record = table.timeline.record_of(instants[0])
        assert record is not None and record.seq + table.data_view().delta_offset in set(after) - set(before)
        if name.startswith("after-delta-put"):  # published from the staged copy: the same bytes
            assert Path(scene.path, layout.completed_file(record.seq)).read_bytes() == staged
    return scene, instants


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POINTS))
def test_a_writer_killed_on_the_commit_path_loses_nothing_and_publishes_nothing_half(
    children: dict[str, Child], name: str
) -> None:
    scene, instants = kill_and_recover(children[name], name)
    if POINTS[name].first == "read":
        later_write(scene, 2000)
    table = scene.check()
    # Nothing published half: an instant the kill stopped before its commit point has no record of its own. Its writer
    # is gone (its pid on this host), so the later upsert rolled it back before it started, files and all; every
    # other instant settled.
    dead = [
        i
        for i in instants
        if table.timeline.record_of(i) is None or table.timeline.record_of(i).action == ACTION_ROLLBACK
    ]
    assert dead == ([] if name not in PENDING else instants[1:] if name.startswith("absorb-after-first") else instants)
    assert all(table.timeline.record_of(i).action == ACTION_ROLLBACK for i in dead)
    assert table.timeline.pending() == []
    assert scene.staged() == [], f"staged records remain after later writes: {scene.staged()}"
    assert not list(Path(scene.path).rglob("heartbeats/*")), "a settled instant left its heartbeat"
    dead_dv_files = (
        scene.dv_files()
        - children[name].dv_files
        - {Path(f.path).name for r in table.timeline.completed() for f in r.dv_files}
    )
    assert not dead_dv_files, "a rolled back instant left its DV file"
    for instant in dead:
        assert table.rollback(instant).rolled_back == instant  # settled already: its rollback record
        assert not [p for p in Path(scene.path).rglob(f"*{instant}*")], "a rolled back instant left files"
    later_write(scene, 3000)  # and again, over the files the first later write rewrote
    scene.check()


def test_a_staged_record_of_a_writer_killed_before_its_put_is_swept_by_a_later_write(
    children: dict[str, Child],
) -> None:
    scene, _ = kill_and_recover(children[SWEPT], "after-staging-before-delta-put")  # a later write ran
    assert scene.staged() == []


def test_dbidx_rollback_of_a_writer_killed_after_its_delta_put_is_refused(children: dict[str, Child]) -> None:
    """A user sees the dead writer's pending instant (`dbidx commits`) and rolls it back before any dbidx process
    read the table: its Delta version is on storage, so it is committed, and the rollback must refuse."""
    from click.testing import CliRunner

    from dbidx.cli import main

    child = children[ROLLBACK]
    scene, killed = child.scene, started(child.lines(), "commit")[0]
    assert Table.open(scene.path).timeline.pending() == [killed]
    result = CliRunner().invoke(main, ["rollback", scene.path, killed])
    apply(scene.model, BATCH)  # committed: its Delta version is on storage
    scene.check()
    assert result.exit_code != 0 and "completed" in result.output, result.output


def test_a_failed_record_create_after_the_delta_put_keeps_the_committed_batch(
    template: Scene, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.faults import record_create_fails_once

    scene = copy_scene(template, tmp_path)
    failed = record_create_fails_once(monkeypatch)
    before = scene.versions()
    with contextlib.suppress(OSError):  # whether the upsert then reports its commit is not what this test asks
        upsert_arrow(
            arrow(BATCH),
            Table.open(scene.path),
            key="id",
            partition="dt",
            cache_config=CacheConfig(base_path=scene.cache),
        )
    monkeypatch.undo()
    assert failed and max(before) + 1 in scene.versions()  # the record failed after the Delta put: committed
    apply(scene.model, BATCH)
    scene.check()
