"""Two races between writers and readers of one table, each closed and shown to be (issue 42, item 9).

1. build-index only initialises an index that has no write yet. That must hold when it publishes, not only when it
   looked: a commit landing meanwhile, or a second build-index (of a Parquet data set or of a Delta table), leaves
   exactly one winner, and the loser publishes nothing and raises a ConflictError naming what to run instead.
2. A Table's read methods read its index view under the view lock: another thread's refresh folds records into the
   same view in place, and incremental_files / incremental_plan iterating it beside that failed ("dictionary changed
   size during iteration"), and a snapshot could take a seq ahead of a half-folded compaction (rows missing).

Each race is widened at one precise point (a pause where the other party must act), on real tables in tmp dirs.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from dbidx.cli import main
from dbidx.errors import ConflictError, InvalidInputError
from dbidx.table import build_index as build_module
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.storage.index_view import IndexView

KEYS = ["k1", "k2", "k3", "k4"]


def _parquet_data_set(root: Path) -> None:
    """A hive-partitioned Parquet data set of KEYS (what build-index indexes by reference)."""
    for dt, keys in (("dt=a", KEYS[:2]), ("dt=b", KEYS[2:])):
        (root / dt).mkdir(parents=True)
        pq.write_table(pa.table({"id": keys, "v": list(range(len(keys)))}), root / dt / f"part-{uuid.uuid4()}.parquet")


def _delta_table(root: Path) -> None:
    """A Delta table of KEYS another engine wrote (what build-index adopts)."""
    write_deltalake(
        str(root), pa.table({"id": KEYS, "dt": ["a", "a", "b", "b"], "v": list(range(4))}), partition_by=["dt"]
    )


def _actions(root: Path) -> list[str]:
    table = Table.open(str(root))
    table.refresh()
    return [r.action for r in table.timeline.completed()]


def _assert_names_remedies(message: str, root: Path) -> None:
    assert f"dbidx sync {root}" in message, message
    assert f"dbidx build-index {root} --key id --readopt" in message, message


def _run_once_at(monkeypatch: pytest.MonkeyPatch, point: str, act: Callable[[], None]) -> None:
    """Run `act` (another writer) once, when build-index first calls the module function `point`."""
    original = getattr(build_module, point)
    done: list[bool] = []

    def calling(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            act()
        return original(*args, **kwargs)

    monkeypatch.setattr(build_module, point, calling)


# ---- 1. build-index against other writers ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "point",
    [
        "list_data_files",  # after build-index's "no write yet" check, before its instant starts
        "_read_source",  # inside its instant, before its publish
    ],
)
def test_a_commit_landing_while_build_index_runs_wins_and_the_build_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    root = tmp_path / "t"
    _parquet_data_set(root)
    table = Table.create(str(root), num_shards=2)

    def commit_from_another_process() -> None:  # its own Table object, on its own thread: a second writer
        def run() -> None:
            other = Table.open(str(root))
            with other.new_commit() as commit:
                commit.insert("dt=c", ["z1"], "fg-z")

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

    _run_once_at(monkeypatch, point, commit_from_another_process)
    with pytest.raises(ConflictError, match="lost the race for the table's first index") as caught:
        build_index(table, "id")
    _assert_names_remedies(str(caught.value), root)
    assert "Nothing of this build was published" in str(caught.value)
    assert _actions(root) == ["commit", "rollback"]  # the commit stands; the build rolled back
    fresh = Table.open(str(root))
    assert fresh.timeline.pending() == []
    assert fresh.lookup(["z1"], "dt=c").column("key").to_pylist() == ["z1"]
    assert fresh.lookup(KEYS[:2], "dt=a").num_rows == 0  # nothing of the build is indexed
    assert len(list(root.rglob("part-*.parquet"))) == 2  # the source files are never touched


@pytest.mark.parametrize("source", ["parquet", "delta"])
def test_two_build_index_runs_at_once_exactly_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Both pass the "no write yet" check; the first to take the Delta version pauses before it publishes its
    record (the widest window: its version is on storage, its record not yet), so the other meets that version."""
    root = tmp_path / "t"
    (_parquet_data_set if source == "parquet" else _delta_table)(root)
    Table.create(str(root), num_shards=2)
    both_checked, waited = threading.Barrier(2), set()
    read_source = build_module._read_source

    def reading(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() not in waited:  # each build's first read: both are past their checks
            waited.add(threading.get_ident())
            try:
                both_checked.wait(timeout=5)
            except threading.BrokenBarrierError:
                pass  # the other build failed before its reads: the assertions below say how
        return read_source(*args, **kwargs)

    commit_point = Table._commit_point

    def slow_commit_point(self: Table, record: Any) -> bool:
        taken = commit_point(self, record)
        if taken and record.action == "build_index":
            time.sleep(0.3)  # between the build's Delta version and its record
        return taken

    monkeypatch.setattr(build_module, "_read_source", reading)
    monkeypatch.setattr(Table, "_commit_point", slow_commit_point)
    outcomes: list[Any] = []

    def build() -> None:
        try:
            outcomes.append(build_index(Table.open(str(root)), "id").instant)
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(outcomes) == 2 and len(errors) == 1, outcomes
    assert isinstance(errors[0], ConflictError), repr(errors[0])
    _assert_names_remedies(str(errors[0]), root)
    assert _actions(root) == ["build_index", "rollback"]
    fresh = Table.open(str(root))
    assert fresh.timeline.pending() == []
    assert verify_table(fresh).ok
    assert sorted(fresh.lookup(KEYS[:2], "dt=a").column("key").to_pylist()) == KEYS[:2]
    if source == "delta":  # the adoption is version 1, the loser's rollback version 2; Delta readers see the rows
        delta = DeltaTable(str(root))
        assert delta.version() == 2
        assert (
            sorted(QueryBuilder().register("t", delta).execute("select id from t").read_all().column("id").to_pylist())
            == KEYS
        )


@pytest.mark.parametrize("source", ["parquet", "delta"])
def test_build_index_on_an_indexed_table_names_sync_and_readopt(tmp_path: Path, source: str) -> None:
    root = tmp_path / "t"
    (_parquet_data_set if source == "parquet" else _delta_table)(root)
    build_index(Table.create(str(root), num_shards=2), "id")
    with pytest.raises(InvalidInputError, match="already has 1 committed instant.*it has an index") as caught:
        build_index(Table.open(str(root)), "id")
    _assert_names_remedies(str(caught.value), root)
    result = CliRunner().invoke(main, ["build-index", str(root), "--key", "id"])
    assert result.exit_code == 2, result.output
    assert "dbidx sync" in result.output and "--readopt" in result.output, result.output
    assert _actions(root) == ["build_index"]


# ---- 2. reads beside another thread's refresh -----------------------------------------------------------------
class _SlowlyIterated(dict):
    """The view's files by path, iterated with a pause per file: a reader listing them while another thread folds
    a record in meets the change every time, not only when the GIL happens to switch in the middle."""

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        for value in super().values():
            yield value
            time.sleep(0.001)


def test_incremental_reads_beside_a_refreshing_thread_and_a_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader thread lists incremental files and plans in a loop, while another thread refreshes the same Table
    (folding records one by one, a pause between) and another Table object commits. Without the lock around the
    listing, the refresh adds files while the listing iterates them."""
    root = tmp_path / "t"
    Table.create(str(root), num_shards=1, checkpoint_interval=0)
    init, apply = IndexView.__init__, IndexView.apply

    def slow_init(self: IndexView) -> None:
        init(self)
        self._by_path = _SlowlyIterated()

    def apply_one_by_one(self: IndexView, records: list) -> None:  # a refresh folding records, a pause between
        for record in records:
            apply(self, [record])
            time.sleep(0.002)

    monkeypatch.setattr(IndexView, "__init__", slow_init)
    monkeypatch.setattr(IndexView, "apply", apply_one_by_one)
    reader = Table.open(str(root))
    published = [0]  # every seq up to this one is published (the log has no gaps)
    stop, errors = threading.Event(), []

    def write() -> None:  # another Table object: another process's writer, as far as the reader can tell
        writer = Table.open(str(root))
        try:
            for i in range(24):
                partition = f"p{i % 2}"
                with writer.new_commit() as commit:
                    commit.insert(partition, [f"{partition}-{i}"], "fg")
                published[0] = writer.timeline.latest_seq
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((exc, traceback.format_exc()))

    def refresh() -> None:
        try:
            while not stop.is_set():
                reader.refresh(force=True)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((exc, traceback.format_exc()))

    def read() -> None:
        while not stop.is_set() and not errors:
            end = published[0]
            try:
                files = reader.incremental_files(0, end)
                assert [seq for seq, _record in files] == list(range(1, end + 1)), (files, end)
                plan = reader.incremental_plan(0, end)
                assert sum(rows for rows, _cleaned in plan.values()) == end, (plan, end)
                assert not any(cleaned for _rows, cleaned in plan.values()), plan
                everything = [seq for seq, _record in reader.incremental_files(0, None)]
                assert everything == list(range(1, len(everything) + 1)) and len(everything) >= end, everything
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((exc, traceback.format_exc()))

    writer = threading.Thread(target=write)
    others = [threading.Thread(target=refresh), threading.Thread(target=read)]
    for thread in [writer] + others:
        thread.start()
    writer.join(60)
    stop.set()
    for thread in others:
        thread.join(60)
    assert not errors, "\n".join(trace for _exc, trace in errors[:3])
    assert published[0] == 24
    assert reader.incremental_plan(0, 24) == {"p0": (12, False), "p1": (12, False)}


def test_a_snapshot_beside_a_refresh_folding_a_compaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """snapshot takes its seq and its file lists from one state of the view. Widened at the one point where that
    fails: right after the reader's own refresh, another Table object compacts the group and a second thread's
    refresh of the reader folds that compaction up to its base and pauses there (the deltas replaced, the base not
    in yet), with the timeline already at the compaction's seq."""
    root = tmp_path / "t"
    Table.create(str(root), num_shards=1, checkpoint_interval=0)
    writer = Table.open(str(root))
    for batch in ("a", "b"):
        with writer.new_commit() as commit:
            commit.insert("p", [f"{batch}{i}" for i in range(10)], "fg")
    reader = Table.open(str(root))
    reader.refresh()
    half_folded, resume = threading.Event(), threading.Event()
    folder: list[threading.Thread] = []
    add, refresh = IndexView._add, Table.refresh

    def pausing_add(self: IndexView, added: Any) -> None:
        if added.record.kind == "base" and threading.current_thread() in folder:
            half_folded.set()
            resume.wait(5)
        add(self, added)

    def reader_refresh(force: bool = False) -> IndexView:
        view = refresh(reader, force)
        if threading.current_thread() is threading.main_thread() and not folder:
            writer.compact()  # another process's compaction, published now
            folder.append(threading.Thread(target=reader.refresh, kwargs={"force": True}))
            folder[0].start()
            half_folded.wait(1)  # never set while the snapshot holds the view lock: the fold waits for it
        return view

    monkeypatch.setattr(IndexView, "_add", pausing_add)
    monkeypatch.setattr(reader, "refresh", reader_refresh)
    try:
        rows = reader.snapshot("p").num_rows
    finally:
        resume.set()
        for thread in folder:
            thread.join(10)
    assert folder, "the widening did not run"
    assert rows == 20
    assert reader.snapshot("p").num_rows == 20  # and after the compaction, from its base
