"""Issue 44 item 3, crash safety of the table services: a child process running `clean`, index `compact` or
`compact_data` is SIGKILLed (a real kill -9) at each step where it leaves something on storage: its claim, its
rollback plan, a base half written (a temp file), some bases written, its record staged, its Delta version put, its
record published, part of a clean's deletions done. Then:

- every reader (dbidx, deltalake, polars, DuckDB) reads the rows of before (a service never changes them), and the
  table verifies;
- `dbidx repair` (or, for some points, the next run of the same service) removes every leftover and `repair` says
  what it swept, by category;
- no file under the table remains that no record or Delta version names, and no file a clean listed; the only
  leftover a sweep leaves on purpose is a temp file younger than an hour (a live writer's, for all it knows), and
  that one goes once it is an hour old.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout
from dbidx.storage.records import ACTION_CLEAN, ACTION_ROLLBACK

from tests.delta_readers import assert_readers_agree, via_dbidx
from tests.retention import clean_without_waiting

COLUMNS = ("id", "dt", "v")
DAYS = ("d1", "d2", "d3")

# The children: one process imports dbidx once, then forks a child per kill point (all at once), each on its own
# copy of the table; a child opens the table, installs the kill and runs one service, its output in `<table>.out`.
# when: "before" / "after" the nth matching call, or "temp": instead of that write_atomic, write its temp file (as
# write_atomic does on a local filesystem) and die before the rename. A child's exit code 3: it never reached the
# kill point. The forking process writes each child's end (-9: SIGKILL) to `<table>.status`.
CHILDREN = textwrap.dedent("""
    import json, os, re, signal, sys, uuid
    from dbidx.table.facade import Table
    from dbidx.storage.fileio import FileIO
    from dbidx.storage.timeline import Timeline

    def run(path, service, method, pattern, when, nth):
        seen = [0]

        def die(*what):
            print("KILLED", *what, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        def wrap(name):
            real = getattr(FileIO, name)

            def patched(self, rel, *args, **kwargs):
                hit = name == method and re.search(pattern, rel) is not None
                if hit:
                    seen[0] += 1
                if hit and seen[0] == nth and when == "before":
                    die("before", name, rel)
                if hit and seen[0] == nth and when == "temp":
                    parent = rel.rsplit("/", 1)[0]
                    self.makedirs(parent)
                    with self.fs.open_output_stream(self.path(f"{parent}/.tmp-{uuid.uuid4().hex}")) as out:
                        out.write(bytes(args[0])[:100])
                    die("temp", name, rel)
                result = real(self, rel, *args, **kwargs)
                if hit and seen[0] == nth and when == "after":
                    die("after", name, rel)
                return result

            setattr(FileIO, name, patched)

        for name in ("write_atomic", "create_exclusive", "delete"):
            wrap(name)
        real_start = Timeline.start

        def start(self, act, *args, **kwargs):
            started = real_start(self, act, *args, **kwargs)
            print("STARTED", act, started.instant, flush=True)
            return started

        Timeline.start = start
        table = Table.open(path)
        if service == "clean":
            table.clean(retain_completions=0)
        elif service == "compact":
            table.compact()
        else:
            table.compact_data(target_file_bytes=None)
        print("SURVIVED", flush=True)

    children = {}
    for job in json.loads(sys.argv[1]):
        pid = os.fork()
        if pid == 0:
            out = os.open(job[0] + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            try:
                run(job[0], job[1], job[2], job[3], job[4], int(job[5]))
            finally:
                os._exit(3)
        children[pid] = job[0]
    for pid, path in children.items():
        _, status = os.waitpid(pid, 0)
        end = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with open(path + ".status", "w") as f:
            f.write(str(end))
""")

INFLIGHT = r"^\.dbidx/timeline/\d{17}\.inflight$"
STAGED = r"^\.dbidx/timeline/staged/"
DELTA = r"^_delta_log/\d{20}\.json$"
COMPLETED = r"^\.dbidx/timeline/completed/"
INDEX_BASE = r"^\.dbidx/rli/.*/base-\d{17}\.parquet$"
DATA_BASE = r"^dt=d\d/[^/]*_\d{17}_0\.parquet$"
DOOMED = r"\.parquet$"


@dataclass(frozen=True)
class Point:
    """Where the child dies: the `nth` call of FileIO.`method` on a path matching `pattern`, `when` it runs."""

    service: str  # clean, compact (index) or compact_data
    method: str
    pattern: str
    when: str
    nth: int = 1
    committed: bool = False  # the service's instant completes (its Delta version is on storage)
    recover: str = "repair"  # who sweeps: `dbidx repair`, or the next run of the same service ("service")
    left: bool = True  # something is left after the first reader (which publishes a staged record and, but for a
    # clean's, removes its dead writer's claim)


def _points() -> dict[str, Point]:
    out: dict[str, Point] = {}
    for service, base in (("compact", INDEX_BASE), ("compact_data", DATA_BASE)):
        out |= {
            f"{service}-claimed": Point(service, "create_exclusive", r"\.requested$", "after"),
            f"{service}-planned": Point(service, "write_atomic", INFLIGHT, "after"),
            f"{service}-base-half-written": Point(service, "write_atomic", base, "temp", nth=2),
            f"{service}-some-bases-written": Point(service, "write_atomic", base, "after", nth=2, recover="service"),
            f"{service}-staged": Point(service, "write_atomic", STAGED, "after"),
            f"{service}-delta-put": Point(
                service, "create_exclusive", DELTA, "after", committed=True, recover="service", left=False
            ),
            f"{service}-published": Point(service, "create_exclusive", COMPLETED, "after", committed=True),
        }
    out |= {
        "clean-claimed": Point("clean", "create_exclusive", r"\.requested$", "after"),
        "clean-staged": Point("clean", "write_atomic", STAGED, "after"),
        "clean-delta-put": Point("clean", "create_exclusive", DELTA, "after", committed=True),
        "clean-published": Point("clean", "create_exclusive", COMPLETED, "after", committed=True),
        "clean-published-next-clean": Point(
            "clean", "create_exclusive", COMPLETED, "after", committed=True, recover="service"
        ),
        "clean-some-deleted": Point("clean", "delete", DOOMED, "after", nth=2, committed=True, recover="service"),
        "clean-some-deleted-repair": Point("clean", "delete", DOOMED, "after", nth=3, committed=True),
    }
    return out


POINTS = _points()


def arrow(rows: list[tuple[str, str, int]]) -> pa.Table:
    return pa.table(
        {"id": [r[0] for r in rows], "dt": [r[1] for r in rows], "v": pa.array([r[2] for r in rows], pa.int64())}
    )


@dataclass
class Scene:
    path: str
    rows: set[tuple[str, str, int]]


def _upserts(path: str, cache: str) -> set[tuple[str, str, int]]:
    """Three batches over two shards and three days: each (day, shard) gets several index deltas and each file
    group several small data files; returns the table's rows."""
    table = Table.create(path, num_shards=2)
    if hasattr(table, "configure_services"):  # services run by the writer would compact the setup away
        table.configure_services(after_commit=False)
    model: dict[str, tuple[str, int]] = {}
    for batch in range(3):
        rows = [(f"k{i}", DAYS[i % 3], batch * 100 + i) for i in range(batch * 4, 12 + batch * 4)]
        upsert_arrow(arrow(rows), Table.open(path), key="id", partition="dt", cache_config=CacheConfig(base_path=cache))
        model |= {k: (d, v) for k, d, v in rows}
    return {(k, d, v) for k, (d, v) in model.items()}


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scene]:
    """ "compact": a table with deltas and small files to compact; "clean": the same, compacted both ways (files to
    clean: index, data and DV files, the table's retention of removed files cut to a millisecond)."""
    base = tmp_path_factory.mktemp("templates")
    rows = _upserts(str(base / "compact"), str(base / "cache"))
    shutil.copytree(base / "compact", base / "clean", symlinks=True)
    table = Table.open(str(base / "clean"))
    assert table.compact().record is not None
    assert table.compact_data(target_file_bytes=None).record is not None
    clean_without_waiting(table)
    return {"compact": Scene(str(base / "compact"), rows), "clean": Scene(str(base / "clean"), rows)}


@dataclass
class Child:
    scene: Scene
    point: Point
    forker: subprocess.Popen

    def lines(self) -> list[str]:
        """Wait for the children; this one's stdout lines (it must have died of its own SIGKILL at the kill point)."""
        if self.forker.poll() is None:
            stdout, stderr = self.forker.communicate(timeout=120)
            assert self.forker.returncode == 0, (stdout, stderr)
        status = Path(self.scene.path + ".status")
        out = Path(self.scene.path + ".out").read_text()
        assert status.exists() and int(status.read_text()) == -signal.SIGKILL, out
        lines = out.splitlines()
        assert lines and lines[-1].startswith("KILLED"), out
        return lines


@pytest.fixture(scope="module")
def children(
    templates: dict[str, Scene], tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, Child]]:
    """The children of the selected tests, all forked at once by one process (each on its own copy of its
    template): the module costs one import of dbidx, not one per kill point."""
    here = Path(__file__).resolve()
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if Path(str(item.path)).resolve() == here and hasattr(item, "callspec")
    }
    scenes: dict[str, Scene] = {}
    for name in [n for n in POINTS if n in selected]:
        template = templates["clean" if POINTS[name].service == "clean" else "compact"]
        path = tmp_path_factory.mktemp(name) / "t"
        shutil.copytree(template.path, path, symlinks=True)
        scenes[name] = Scene(str(path), template.rows)
    jobs = [[scenes[n].path, p.service, p.method, p.pattern, p.when, p.nth] for n, p in POINTS.items() if n in scenes]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    forker = subprocess.Popen(
        [sys.executable, "-c", CHILDREN, json.dumps(jobs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield {name: Child(scene, POINTS[name], forker) for name, scene in scenes.items()}
    finally:
        if forker.poll() is None:
            forker.kill()
        forker.communicate(timeout=30)


def all_files(path: str) -> set[str]:
    root = Path(path)
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def unnamed_files(table: Table) -> set[str]:
    """Files under the table that nothing names: not the table's metadata (properties, service settings, the
    completion log and its pointer, checkpoints, archive bundles, the Delta log), and not a file of a record that no
    clean has deleted. Also every file a clean listed that is still there."""
    table.timeline.refresh()
    records = table.timeline.completed()
    cleaned = {p for r in records if r.action == ACTION_CLEAN for p in r.deleted}
    named = {f.path for r in records for f in (*r.files, *r.data_files, *r.dv_files)} - cleaned
    meta = (
        layout.PROPERTIES_FILE,
        layout.COMPLETED_DIR + "/",
        layout.LATEST_DIR + "/",
        layout.CHECKPOINT_DIR + "/",
        layout.ARCHIVE_DIR + "/",
        "_delta_log/",
        f"{layout.META_DIR}/services.json",
    )  # the table service settings
    return {f for f in all_files(table.io.root) if not f.startswith(meta) and f not in named}


def repair(path: str) -> dict:
    result = CliRunner().invoke(main, ["repair", path, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def check_rows(scene: Scene) -> Table:
    table = Table.open(scene.path)
    assert_readers_agree(table, COLUMNS, scene.rows)
    check = verify_table(table)
    assert check.ok, check
    return table


def run_service(path: str, service: str) -> None:
    table = Table.open(path)
    if service == "clean":
        table.clean(retain_completions=0)
    elif service == "compact":
        table.compact()
    else:
        table.compact_data(target_file_bytes=None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POINTS))
def test_a_service_killed_at_each_step_loses_nothing_and_its_leftovers_are_swept(
    children: dict[str, Child], name: str
) -> None:
    child, point = children[name], POINTS[name]
    scene = child.scene
    lines = child.lines()
    started = [line.split()[2] for line in lines if line.startswith("STARTED ")]
    [instant] = started or re.findall(r"\d{17}", lines[-1])  # killed inside the start: the claim's name
    before = all_files(scene.path)
    # 1. Readers read the rows of before, whatever the step (the first of them publishes a record whose Delta
    #    version is on storage).
    table = check_rows(scene)
    record = table.timeline.record_of(instant)
    assert (record is not None and record.action != ACTION_ROLLBACK) == point.committed, record
    # 2. Something was left: the claim at least (a settled clean keeps its claim until its deletions are done).
    leftovers = unnamed_files(table)
    assert any(instant in f for f in leftovers) == point.left, leftovers
    # 3. The sweep: the next run of the service, or `dbidx repair`.
    if point.recover == "service":
        run_service(scene.path, point.service)
        report = repair(scene.path)
        assert report["leftovers_deleted"] == 0 and report["rolled_back"] == [], report
    else:
        report = repair(scene.path)
        assert report["leftovers_deleted"] == sum(v for k, v in report["swept"].items() if k != "rolled_back")
        assert report["leftovers_deleted"] > 0 or report["rolled_back"], report
        if not point.committed:
            assert report["rolled_back"] == [instant], report
        if point.service == "clean" and point.committed:
            assert report["swept"]["cleaned_files"] > 0, report
            assert report["swept"]["timeline_files"] > 0, report  # its claim, kept until the deletions were done
    table = check_rows(scene)
    if not point.committed:
        assert table.timeline.record_of(instant).action == ACTION_ROLLBACK
    assert table.timeline.pending() == []
    # 4. Nothing is left that nothing names, but a fresh temp file (a live writer's, for all a sweep knows) ...
    left = unnamed_files(table)
    assert {Path(f).name[:5] for f in left} <= {".tmp-"}, left
    assert bool(left) == (point.when == "temp"), left
    assert left <= before
    # 5. ... which goes once it is an hour old.
    for f in left:
        os.utime(table.io.path(f), (1e9, 1e9))
    if left:
        report = repair(scene.path)
        assert report["swept"]["temp_files"] == len(left), report
    assert unnamed_files(Table.open(scene.path)) == set()
    # 6. And the service runs again to its end (nothing it left stands in its way).
    run_service(scene.path, point.service)
    table = Table.open(scene.path)
    assert set(via_dbidx(table, COLUMNS)) == scene.rows
    assert unnamed_files(table) == set()


def test_repair_finds_the_files_of_a_clean_that_died_before_its_claim_said_so(
    templates: dict[str, Scene], tmp_path: Path
) -> None:
    """A clean of an older dbidx removed its claim before deleting: nothing tells the sweep. `dbidx repair` checks
    every clean record's files (one listing per directory) and deletes those still there; a service run does not
    need to."""
    path = tmp_path / "t"
    shutil.copytree(templates["clean"].path, path, symlinks=True)
    table = Table.open(str(path))
    record = table.clean(retain_completions=0)
    assert record is not None and record.deleted
    kept = {rel: b"left by a dead clean" for rel in record.deleted[:3]}
    for rel, data in kept.items():
        Path(table.io.path(rel)).write_bytes(data)
    assert unnamed_files(Table.open(str(path))) == set(kept)
    report = repair(str(path))
    assert report["swept"]["cleaned_files"] == len(kept) and report["leftovers_deleted"] == len(kept), report
    assert unnamed_files(Table.open(str(path))) == set()
    check_rows(Scene(str(path), templates["clean"].rows))


def test_a_clean_record_naming_files_the_table_still_needs_deletes_none_of_them(
    templates: dict[str, Scene], tmp_path: Path
) -> None:
    """The paths of a clean record are read back (untrusted): a live data file, a live index file, a DV file a live
    vector points into, the Delta log, the table's properties and a path outside the table are never deleted by the
    sweep that finishes a dead clean, only what a clean may delete."""
    from dbidx.storage.records import CompletedInstant

    path = tmp_path / "t"
    shutil.copytree(templates["clean"].path, path, symlinks=True)
    table = Table.open(str(path))
    data = table.data_view()
    live_data = sorted(f.record.path for f in data.live())[0]
    live_index = table.refresh().files("dt=d1", 0)[0].path
    live_dv = sorted({data.vector_of(f.record.path).file.path for f in data.live() if data.vector_of(f.record.path)})
    doomed = [p for p, _ in table.refresh().replaced_files(table.timeline.latest_seq)][:1]
    assert doomed
    crafted = [live_data, live_index, *live_dv[:1], "_delta_log/00000000000000000000.json", layout.PROPERTIES_FILE]
    writer = table.timeline.start(ACTION_CLEAN)
    table.timeline.publish(
        writer,
        lambda seq: CompletedInstant(
            seq=seq,
            instant=writer.instant,
            action=ACTION_CLEAN,
            table_id=table.props.table_id,
            completed_at_ms=1,
            start_seq=writer.start_seq,
            deleted=tuple(crafted + doomed),
        ),
        keep_claim=True,
    )
    table.timeline.stop_heartbeat(writer.instant, delete=False)
    report = Table.open(str(path)).sweep_leftovers()
    assert report.cleaned_files == doomed
    assert all(Path(table.io.path(p)).exists() for p in crafted)
    assert not Path(table.io.path(doomed[0])).exists()
    assert not Path(table.io.path(layout.requested_file(writer.instant))).exists()
