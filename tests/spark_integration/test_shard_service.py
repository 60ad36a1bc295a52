"""The cache service (cache.service): real service processes, real sockets, real RocksDB caches and Parquet files.

A service per shard cache directory runs the shard's upsert work with the cache held open between tasks; the
results must be those of a task doing the work itself, a service must go when idle, let any other opener of its
directory in, be replaced when killed between tasks, and fail an attempt loudly when killed in the middle of one.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pytest

from dbidx.cache import service_link
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import CacheServiceError
from dbidx.spark_integration import service_client, shard_service, task
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.tagger import TagOptions
from dbidx.table.facade import Table

DAYS = ["2025-03-01", "2025-03-02", "2025-03-03"]


def rows(lo: int, hi: int, ver: int) -> pa.Table:
    return pa.table(
        {
            "id": [f"k{i:05d}" for i in range(lo, hi)],
            "dt": [DAYS[i % 3] for i in range(lo, hi)],
            "ver": [ver] * (hi - lo),
        }
    )


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, short runtime directory for this test's services (a socket path must stay under 108 bytes);
    every service still running at the end is killed."""
    base = Path(tempfile.mkdtemp(prefix="svc", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    yield base / "dbidx"
    for pid_file in (base / "dbidx").glob("*.pid"):
        pid = _pid(pid_file)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _pid(pid_file: Path) -> int | None:
    text = pid_file.read_text().strip() if pid_file.exists() else ""
    return int(text) if text else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent, this test process) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # it exited (and was reaped) between the two looks
        return False


def _wait(check, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _listening(path: Path) -> bool:
    conn = service_link.connect(path)
    if conn is not None:
        conn.close()
    return conn is not None


def config(tmp_path: Path, **extra: str) -> CacheConfig:
    return CacheConfig.from_sources({"base_path": str(tmp_path / "cache"), "service": "true", **extra})


def served_pids(runtime: Path) -> list[int]:
    return sorted(p for f in runtime.glob("*.pid") if (p := _pid(f)) is not None and _alive(p))


def contents(table: Table) -> list[tuple]:
    data = read_arrow(table, columns=["id", "dt", "ver"])
    return sorted(zip(*(data.column(c).to_pylist() for c in ("id", "dt", "ver"))))


def test_upserts_through_the_service_read_back_as_upserts_done_in_the_task(tmp_path: Path, runtime: Path) -> None:
    direct = Table.create(str(tmp_path / "direct"), num_shards=2)
    served = Table.create(str(tmp_path / "served"), num_shards=2)
    direct_config = CacheConfig(base_path=str(tmp_path / "direct-cache"))
    served_config = config(tmp_path, **{"service.idle.s": "30"})
    summaries = []
    for ver, (lo, hi) in enumerate([(0, 600), (300, 900), (100, 1200), (0, 50)], start=1):
        upsert_arrow(rows(lo, hi, ver), direct, key="id", partition="dt", cache_config=direct_config)
        summaries.append(upsert_arrow(rows(lo, hi, ver), served, key="id", partition="dt", cache_config=served_config))
    assert contents(served) == contents(direct)
    # The first write is a bulk load (no cache: done in the task); every batch after it went to the two services,
    # which kept their caches open: no open after their first request.
    assert [m["served"] for m in summaries[0].per_shard] == [0, 0]
    assert all(m["served"] == 1 and m["service_seconds"] > 0 for s in summaries[1:] for m in s.per_shard)
    assert all(m["open_seconds"] == 0 for s in summaries[2:] for m in s.per_shard)
    assert summaries[2].updates > 0 and summaries[2].inserts > 0
    # One service per shard, its socket private to the user.
    assert len(served_pids(runtime)) == 2
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    sockets = list(runtime.glob("*.sock"))
    assert len(sockets) == 2 and all(stat.S_IMODE(s.stat().st_mode) == 0o600 for s in sockets)


def served_table(tmp_path: Path, idle_s: float = 60) -> tuple[Table, CacheConfig]:
    """A one-shard table after a load (done in the task) and one batch (done by the service it started)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path, **{"service.idle.s": str(idle_s)})
    upsert_arrow(rows(0, 100, 1), table, key="id", partition="dt", cache_config=cfg)
    upsert_arrow(rows(50, 150, 2), table, key="id", partition="dt", cache_config=cfg)
    return table, cfg


@pytest.mark.slow
def test_an_idle_service_exits_and_leaves_the_cache_closed(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=1)
    assert _wait(lambda: served_pids(runtime) != [])
    assert _wait(lambda: served_pids(runtime) == [] and not list(runtime.glob("*.sock")))
    assert not list(runtime.glob("*.pid"))  # a clean exit leaves only its log
    with RecordIndexCache.for_table(table, 0, CacheConfig(base_path=cfg.base_path, lock_timeout_s=1)) as cache:
        assert cache.lookup("dt=2025-03-01", ["k00000"]) != [None]  # the service closed it cleanly, caught up


def test_another_opener_of_the_directory_makes_the_service_let_go(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)
    (pid,) = served_pids(runtime)
    started = time.monotonic()
    with RecordIndexCache.for_table(table, 0, CacheConfig(base_path=cfg.base_path, lock_timeout_s=20)) as cache:
        assert time.monotonic() - started < 10  # released on request, not after its idle time
        assert cache.lookup("dt=2025-03-02", ["k00001"]) != [None]  # batch 1: caught up by batch 2
    # The service is still there and opens the cache again for the next batch.
    summary = upsert_arrow(rows(100, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    assert served_pids(runtime) == [pid] and summary.per_shard[0]["served"] == 1
    assert len(contents(table)) == 200


@pytest.mark.slow
def test_the_service_catches_up_on_a_commit_before_the_next_task_comes(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)  # batch 2 (50 new keys) was served; its commit landed after
    time.sleep(2.0)  # the service polls for that commit every few ms (a loaded machine: margin)
    summary = upsert_arrow(rows(140, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    (shard,) = summary.per_shard
    assert shard["served"] == 1 and shard["open_seconds"] == 0
    # Batch 2's 50 new keys reached the cache between the tasks, none in batch 3's task, which tagged its 10 keys
    # of batch 2 as updates all the same.
    assert (shard["ahead_entries"], shard["catchup_entries"]) == (50, 0)
    assert (summary.updates, summary.inserts) == (10, 50)
    # A batch that comes before the service could catch up (no pause) catches up in the task, as before.
    summary = upsert_arrow(rows(190, 260, 4), table, key="id", partition="dt", cache_config=cfg)
    assert (summary.updates, summary.inserts) == (10, 60)
    assert summary.per_shard[0]["ahead_entries"] + summary.per_shard[0]["catchup_entries"] == 50
    assert len(contents(table)) == 260


def test_the_service_indexes_a_data_compactions_new_files_before_the_next_task_needs_them(
    tmp_path: Path, runtime: Path
) -> None:
    from dbidx.spark_integration import datafiles

    table, cfg = served_table(tmp_path, idle_s=60)  # batch 2 was served: the service watches the groups it wrote
    compacted = table.compact_data(min_files=2)  # as the table services after a publish would
    assert compacted.record is not None
    bases = list(compacted.record.data_files)
    disk = datafiles.key_files_for(table, 0, cfg)
    assert bases and disk is not None
    # Between requests the service built each new base's key index (kept as a key file too, by its saver thread).
    assert _wait(lambda: all((path := disk.path_of(b)) is not None and path.exists() for b in bases))
    summary = upsert_arrow(rows(140, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    (shard,) = summary.per_shard
    # The next task's search found the bases' key indexes in the service's memory: none decoded from a data file.
    assert shard["served"] == 1
    assert shard["keys_from_data_files"] == 0 and shard["keys_from_memory"] >= len(bases)
    assert (summary.updates, summary.inserts) == (10, 50)
    assert len(contents(table)) == 200


def test_a_bulk_load_leaves_its_service_with_the_cache_open_and_its_partitions_installed(
    tmp_path: Path, runtime: Path
) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path, **{"service.idle.s": "60"})
    upsert_arrow(rows(0, 300, 1), table, key="id", partition="dt", cache_config=cfg)  # bulk: done in the task
    assert _wait(lambda: served_pids(runtime) != [])  # started at the load task's end, told to wait for its commit
    cache = RecordIndexCache.for_table(table, 0, cfg)
    # The service opened the cache once the load's commit landed (it holds the directory's lock); no request file
    # is left in the runtime directory.
    assert _wait(lambda: _locked(cache.path))
    assert not list(runtime.glob("*.ahead"))
    summary = upsert_arrow(rows(250, 350, 2), table, key="id", partition="dt", cache_config=cfg)
    (shard,) = summary.per_shard
    # The first batch found the cache open and the load's three partitions installed (staged_loads counts them,
    # done ahead of the task), nothing to catch up; its keys of the load are updates.
    assert shard["served"] == 1 and shard["open_seconds"] == 0
    assert (shard["staged_loads"], shard["catchup_entries"], shard["reloads"]) == (3, 0, 0)
    assert (summary.updates, summary.inserts) == (50, 50)
    assert len(contents(table)) == 350


def _locked(cache_dir: Path) -> bool:
    """Whether some process holds the cache directory's flock (a probe that lets go at once)."""
    import fcntl

    from dbidx.cache.dir_lock import lock_path

    fd = os.open(str(lock_path(cache_dir)), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.slow
def test_a_service_killed_between_batches_is_replaced(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)
    (pid,) = served_pids(runtime)
    os.kill(pid, signal.SIGKILL)
    assert _wait(lambda: not _alive(pid))
    summary = upsert_arrow(rows(100, 250, 3), table, key="id", partition="dt", cache_config=cfg)
    assert summary.per_shard[0]["served"] == 1 and summary.updates == 50 and summary.inserts == 100
    (replacement,) = served_pids(runtime)
    assert replacement != pid
    assert contents(table) == sorted(
        [(f"k{i:05d}", DAYS[i % 3], 1) for i in range(0, 50)]
        + [(f"k{i:05d}", DAYS[i % 3], 2) for i in range(50, 100)]
        + [(f"k{i:05d}", DAYS[i % 3], 3) for i in range(100, 250)]
    )


@pytest.mark.slow
def test_a_service_killed_mid_request_fails_the_attempt_and_publishes_nothing(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)
    before = contents(table)
    (pid,) = served_pids(runtime)
    real_receive = service_link.receive

    def kill_once_accepted(conn, where):  # the fault: the service dies right after it took the request
        header, body = real_receive(conn, where)
        if header.get("accepted"):
            os.kill(pid, signal.SIGKILL)
        return header, body

    monkeypatch.setattr(service_link, "receive", kill_once_accepted)
    with pytest.raises(CacheServiceError, match="mid-request|closed"):
        upsert_arrow(rows(100, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    monkeypatch.setattr(service_link, "receive", real_receive)
    assert contents(Table.open(table.uri)) == before  # rolled back: nothing of the failed attempt is visible
    summary = upsert_arrow(rows(100, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    assert summary.per_shard[0]["served"] == 1 and summary.inserts == 50 and summary.updates == 50
    assert len(contents(table)) == 200


def tag_rows(table: Table, cfg: CacheConfig, batches: list[pa.RecordBatch]) -> pa.Table:
    options = TagOptions(key="id", partition="dt", cache=cfg)
    return pa.Table.from_batches(list(task.tag_batches(batches, table, options)))


def requests_served(runtime: Path) -> int:
    return sum(s["requests"] or 0 for s in service_link.running_services())


def test_tag_tasks_are_tagged_by_the_service_as_in_the_task(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)  # k00000-k00149 in the index; the service holds the cache open
    (pid,) = served_pids(runtime)
    # Updates, new keys (one repeated across two Arrow batches: one file group), and deletes of present and absent
    # keys, in two batches.
    probe = rows(100, 200, 3).append_column("_dbidx_delete", pa.array([i % 10 == 0 for i in range(100)]))
    extra = pa.table({"id": ["k00171", "k09999"], "dt": [DAYS[171 % 3], DAYS[0]], "ver": [4, 4]})
    batches = (
        probe.to_batches(max_chunksize=40) + extra.append_column("_dbidx_delete", pa.array([False, True])).to_batches()
    )
    before = requests_served(runtime)
    served = tag_rows(table, cfg, batches)
    assert requests_served(runtime) == before + 1 and served_pids(runtime) == [pid]
    # The same rows tagged by a task that opens its own cache (another directory: the service keeps its own).
    direct = tag_rows(table, CacheConfig(base_path=str(tmp_path / "direct-cache")), batches)
    assert served.equals(direct)
    # k00100-k00149 are in the index (as of the latest commit, which the service caught up to), the rest are not.
    assert served.column("_dbidx_is_update").to_pylist() == [True] * 50 + [False] * 52
    assert served.column("_dbidx_is_delete").to_pylist() == probe.column("_dbidx_delete").to_pylist() + [False, True]
    fg = served.column("_dbidx_file_group").to_pylist()
    assert fg[71] is not None and fg[71] == fg[100]  # k00171, new, in two Arrow batches: one file group
    # The service kept the cache open for the next upsert, which it serves without an open.
    # What the tag's session caught up (batch 2's 50 new keys, unless the service did before) is reported by it.
    summary = upsert_arrow(rows(150, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    (shard,) = summary.per_shard
    assert shard["served"] == 1 and shard["open_seconds"] == 0
    assert (shard["ahead_entries"], shard["catchup_entries"]) == (50, 0)


def test_a_large_tag_task_and_one_of_several_shards_tag_themselves(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)
    before = requests_served(runtime)
    monkeypatch.setattr(task, "TAG_SERVICE_MAX_BYTES", 100)  # past this, the task streams its rows itself
    batches = rows(0, 120, 3).to_batches(max_chunksize=30)
    tagged = tag_rows(table, cfg, batches)
    assert tagged.num_rows == 120 and tagged.column("_dbidx_is_update").to_pylist() == [True] * 120
    assert requests_served(runtime) == before
    # Rows of two shards (not shuffled by shard): tagged in the task, both shards' caches opened there.
    two = Table.create(str(tmp_path / "two"), num_shards=2)
    monkeypatch.undo()
    assert service_client.tag_in_service(rows(0, 50, 1).to_batches(), two, TagOptions("id", "dt", cache=cfg)) is None
    assert tag_rows(two, cfg, rows(0, 50, 1).to_batches()).num_rows == 50


def test_rows_of_several_shards_are_done_in_the_task(tmp_path: Path, runtime: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    options = TagOptions(key="id", partition="dt", cache=config(tmp_path))
    batches = rows(0, 50, 1).to_batches()
    assert service_client.upsert_in_service(batches, table, options, "20250101000000000", 0) is None
    assert served_pids(runtime) == []


def test_a_failure_in_the_service_comes_back_as_its_own_error(tmp_path: Path, runtime: Path) -> None:
    """A request the service cannot serve (here: a table object that does not unpickle) is answered with the error,
    raised in the task with its type when it pickles, else as a CacheServiceError with the service's traceback."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path, **{"service.idle.s": "30"})
    cache_dir = RecordIndexCache.for_table(table, 0, cfg).path
    path = service_link.socket_for(cache_dir)
    conn = service_client._connect_or_start(path, cache_dir, 30, time.monotonic() + 30)
    assert conn is not None
    with conn:
        header = {"op": "upsert", "instant": "x", "attempt": 0, "table": b"not a pickle", "options": pickle.dumps(1)}
        service_link.send(conn, header, b"")
        accepted, _ = service_link.receive(conn, "test")
        reply, _ = service_link.receive(conn, "test")
    assert accepted == {"accepted": True} and reply["ok"] is False
    with pytest.raises(pickle.UnpicklingError):
        service_client._raise(reply, cache_dir)
    with pytest.raises(CacheServiceError, match="UnpicklingError"):
        service_client._raise({k: v for k, v in reply.items() if k != "error"}, cache_dir)


def test_a_runtime_directory_another_user_could_write_is_refused(tmp_path: Path, monkeypatch) -> None:
    base = Path(tempfile.mkdtemp(prefix="svc", dir="/tmp"))
    (base / "dbidx").mkdir(mode=0o777)
    os.chmod(base / "dbidx", 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path)
    upsert_arrow(rows(0, 10, 1), table, key="id", partition="dt", cache_config=cfg)
    # The service is not used (its sockets could be swapped): the task does the work itself, and says why.
    summary = upsert_arrow(rows(5, 15, 2), table, key="id", partition="dt", cache_config=cfg)
    assert summary.per_shard[0]["served"] == 0 and summary.updates == 5
    assert not list((base / "dbidx").iterdir())


def test_a_stopped_service_exits(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)
    (pid,) = served_pids(runtime)
    assert service_link.request_stop(RecordIndexCache.for_table(table, 0, cfg).path)
    assert _wait(lambda: not _alive(pid))
    assert not list(runtime.glob("*.sock"))


@pytest.mark.spark
def test_spark_upserts_through_the_services(spark, tmp_path: Path) -> None:
    """Under Spark the services are started by the Python workers' tasks, outlive them, and serve the next batch's
    tasks whichever worker runs them; the table reads back as written."""
    from dbidx.spark_integration.api import tag, upsert

    table = Table.create(str(tmp_path / "t"), num_shards=2)
    options = {"base_path": str(tmp_path / "cache"), "service": "true", "service.idle.s": "120"}  # stopped below
    summaries = []
    try:
        for ver, (lo, hi) in enumerate([(0, 400), (200, 600), (0, 700)], start=1):
            frame = spark.createDataFrame(rows(lo, hi, ver).to_pandas())
            summaries.append(upsert(frame, table, key="id", partition="dt", cache_options=options))

        # A `tag` job's tasks are tagged by the same services (one request per task).
        def served() -> int:  # this test's services only (other tests' may run beside it)
            mine = [s for s in service_link.running_services() if str(s["cache_dir"]).startswith(str(tmp_path))]
            assert len(mine) == 2
            return sum(s["requests"] for s in mine)

        served_before = served()
        frame = spark.createDataFrame(rows(650, 750, 4).to_pandas())
        updates = tag(frame, table, key="id", partition="dt", cache_options=options).select("_dbidx_is_update")
        assert sorted(r[0] for r in updates.collect()) == [False] * 50 + [True] * 50
        assert served() == served_before + 2
    finally:
        for shard in range(2):
            service_link.request_stop(
                RecordIndexCache.for_table(table, shard, CacheConfig(**{"base_path": options["base_path"]})).path
            )
    assert all(m["served"] == 1 for s in summaries[1:] for m in s.per_shard)
    assert all(m["open_seconds"] == 0 for m in summaries[2].per_shard)
    assert contents(table) == sorted([(f"k{i:05d}", DAYS[i % 3], 3) for i in range(0, 700)])


def test_the_service_s_warnings_are_logged_again_in_the_task(
    tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A warning the service logs while it does a task's work (here: a key-file directory replaced by a symlink) is
    logged again in the task, where the executor's log has it, naming the service."""
    from tests.spark_integration.test_key_files_upsert import key_dir, wait_for_saves

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path, **{"service.idle.s": "30"})
    upsert_arrow(rows(0, 50, 1), table, key="id", partition="dt", cache_config=cfg)
    wait_for_saves()
    keys = key_dir(tmp_path / "cache")
    keys.rename(tmp_path / "bigger-disk")
    keys.symlink_to(tmp_path / "bigger-disk")
    with caplog.at_level(logging.WARNING):
        summary = upsert_arrow(rows(0, 50, 2), table, key="id", partition="dt", cache_config=cfg)
    assert summary.per_shard[0]["served"] == 1
    assert "is a symbolic link" in caplog.text and "[in the cache service on shard-" in caplog.text


@pytest.mark.slow
def test_services_started_at_once_for_one_directory_leave_one(tmp_path: Path, runtime: Path) -> None:
    """Tasks that find no service start one each; the pid file's lock lets one of them serve, the others exit."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path, **{"service.idle.s": "30"})
    cache_dir = RecordIndexCache.for_table(table, 0, cfg).path
    path = service_link.socket_for(cache_dir)
    for _ in range(3):
        service_client.start_service(path, cache_dir, 30)
    assert _wait(lambda: _listening(path))
    time.sleep(1.0)  # the losers' exits
    assert len(served_pids(runtime)) == 1
    assert service_link.request_stop(cache_dir)
    assert _wait(lambda: served_pids(runtime) == [] and not list(runtime.glob("*.pid")))


def test_the_cli_lists_the_services_and_stops_them(tmp_path: Path, runtime: Path) -> None:
    from click.testing import CliRunner

    from dbidx.cli import main

    table, cfg = served_table(tmp_path, idle_s=60)
    (pid,) = served_pids(runtime)
    result = CliRunner().invoke(main, ["cache", "services", "--json"])
    assert result.exit_code == 0, result.output
    (listed,) = json.loads(result.stdout)["services"]
    cache_dir = RecordIndexCache.for_table(table, 0, cfg).path
    assert (listed["pid"], listed["cache_dir"], listed["requests"], listed["busy"]) == (pid, str(cache_dir), 1, False)
    result = CliRunner().invoke(main, ["cache", "services", "--stop"])
    assert result.exit_code == 0, result.output
    assert f"pid {pid}: {cache_dir} (1 tasks served" in result.output and "stopping" in result.output
    assert _wait(lambda: not _alive(pid))
    assert "no cache service runs" in CliRunner().invoke(main, ["cache", "services"]).output


def test_a_client_that_goes_away_mid_message_does_not_wedge_the_service(tmp_path: Path, runtime: Path) -> None:
    table, cfg = served_table(tmp_path, idle_s=60)
    (pid,) = served_pids(runtime)
    path = service_link.socket_for(RecordIndexCache.for_table(table, 0, cfg).path)
    conn = service_link.connect(path)
    assert conn is not None
    conn.sendall(b"\x00\x00\x00\x10\x00")  # half a length prefix, then gone
    conn.close()
    summary = upsert_arrow(rows(100, 200, 3), table, key="id", partition="dt", cache_config=cfg)
    assert summary.per_shard[0]["served"] == 1 and served_pids(runtime) == [pid]
    assert len(contents(table)) == 200


def test_asking_a_service_creates_nothing_where_none_ever_ran(tmp_path: Path, runtime: Path) -> None:
    """Another opener finding a cache busy asks its service to let go; where no service ever started there is none
    to ask, and neither that nor listing services creates the runtime directory."""
    assert not runtime.exists()
    assert service_link.request_release(tmp_path / "cache" / "shard-00000-of-00001") is False
    assert service_link.running_services() == []
    assert not runtime.exists()


def test_a_starting_service_removes_its_socket_s_stale_catch_up_requests(tmp_path: Path, runtime: Path) -> None:
    """A service killed before it read its catch-up request leaves the file; the next service of that socket removes
    it (and leaves a fresh one, which may be the request of a service about to start, and other sockets' files)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cfg = config(tmp_path, **{"service.idle.s": "60"})
    sock = service_link.socket_for(RecordIndexCache.for_table(table, 0, cfg).path)
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    stale, fresh = service_link.ahead_request_path(sock, 1, 2), service_link.ahead_request_path(sock, 3, 4)
    other = service_link.ahead_request_path(runtime / "shard-other.sock", 1, 2)
    for path in (stale, fresh, other):
        path.write_bytes(b"not a request")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(other, (hour_ago, hour_ago))
    upsert_arrow(rows(0, 100, 1), table, key="id", partition="dt", cache_config=cfg)
    upsert_arrow(rows(50, 150, 2), table, key="id", partition="dt", cache_config=cfg)  # served: a service started
    assert served_pids(runtime) != []
    assert (stale.exists(), fresh.exists(), other.exists()) == (False, True, True)
    assert len(contents(table)) == 150


def test_a_service_pays_pyarrow_s_pandas_import_at_start_not_in_its_first_request() -> None:
    """pyarrow imports pandas on its first conversion of Python objects (~0.5 s): `warm_up`, run as a service starts,
    does that conversion, so a fresh process that ran it has pandas loaded before any request comes."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dbidx.spark_integration import shard_service, task\n"
        "before = 'pandas' in sys.modules\n"
        "shard_service.warm_up()\n"
        "print(before, 'pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def test_the_service_log_level_comes_from_the_environment(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert shard_service.log_level({}) == logging.INFO
    assert shard_service.log_level({shard_service.LOG_LEVEL_ENV: " debug "}) == logging.DEBUG
    assert shard_service.log_level({shard_service.LOG_LEVEL_ENV: "loud"}) == logging.INFO  # named, then INFO
    # The task's environment reaches the service it starts: at DEBUG its log has a line per request.
    monkeypatch.setenv(shard_service.LOG_LEVEL_ENV, "DEBUG")
    table, cfg = served_table(tmp_path, idle_s=60)
    tag_rows(table, cfg, rows(0, 10, 3).to_batches())
    (log_file,) = runtime.glob("*.log")
    text = log_file.read_text()
    assert " DEBUG upsert " in text and " DEBUG tag: received in " in text and "served in" in text
