"""Crash safety (a real subprocess killed with SIGKILL mid-write and mid-load) and the TTL / disk-budget reaper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from dbidx.cache.catchup import sync
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.reaper import reap
from dbidx.cache.verify import verify
from dbidx.table.facade import Table

from tests.cache_helpers import DAY1, DAY2, DAY3, make_table, open_cache, truth

REPO_PARENT = str(Path(__file__).resolve().parents[2])

CHILD = textwrap.dedent("""
    import sys, itertools
    from pathlib import Path
    from dbidx.cache.catchup import sync
    from dbidx.cache.loading import load_from_snapshot
    from dbidx.cache.record_cache import RecordIndexCache
    from dbidx.config import CacheConfig
    from dbidx.table.facade import Table

    table = Table.open(sys.argv[1])
    mode = sys.argv[3]
    cache = RecordIndexCache.for_table(table, 0, CacheConfig(), base_path=sys.argv[2]).open()
    for p in ("dt=2025-01-01", "dt=2025-01-02", "dt=2025-01-03"):
        load_from_snapshot(cache, table, p, table.timeline.latest_seq)
    sync(cache, table)
    cache.flush()
    for i in itertools.count():
        if mode == "write":   # another writer's commits, applied by catch-up
            keys = [f"w{i}-{j}" for j in range(400)]
            with table.new_commit() as w:
                w.insert("dt=2025-01-02", keys, f"fg-w{i % 5}")
                if i % 3 == 2:
                    w.delete("dt=2025-01-02", [f"w{i - 2}-{j}" for j in range(100)])
            sync(cache, table)
        elif mode == "ingest":  # catch-ups large enough to arrive as one SST, each naming a new file group
            with table.new_commit() as w:
                w.insert("dt=2025-01-03", [f"i{i}-{j}" for j in range(17_000)], f"fg-i{i}")
            sync(cache, table)
        else:                 # reload the biggest partition over and over
            load_from_snapshot(cache, table, "dt=2025-01-01", table.timeline.latest_seq)
        print(i, flush=True)
""")


def run_and_kill(table: Table, base: Path, mode: str, iterations: int) -> None:
    """Start the child, let it do `iterations` rounds, then SIGKILL it (no chance to flush or close)."""
    env = {**os.environ, "PYTHONPATH": REPO_PARENT}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, table.uri, str(base), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for _ in range(iterations):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["write", "ingest", "load"])
def test_sigkill_then_reopen_verifies_and_answers_like_the_mdt(tmp_path, mode, monkeypatch):
    from dbidx.cache import catchup

    # Recovery must work by applying what the crash lost, however much that is: no reload by size here.
    monkeypatch.setattr(catchup, "RELOAD_FRACTION", float("inf"))
    table = make_table(tmp_path, num_shards=1, keys_per_day=20_000 if mode == "load" else 2_000)
    run_and_kill(table, tmp_path / "cache", mode, iterations=6)
    table = Table.open(table.uri)
    with open_cache(table, 0, tmp_path / "cache") as cache:
        assert cache.recovered  # it knows it was not closed cleanly
        # What survived is consistent at the seq each partition claims ...
        survived = verify(cache, table)
        if mode == "ingest" and not survived.ok:
            # ... except that a kill between a large catch-up's SST ingest and the registry flush right after it
            # (milliseconds) leaves that partition's data ahead of its registry: then it holds only entries the index
            # committed later (never a wrong or a missing one), which the open counted and catch-up replays
            # read-first.
            assert all(d.missing == d.wrong_location == 0 for d in survived.partitions), survived.to_dict()
            assert set(cache.items(DAY3)) <= set(truth(table, DAY3, 0).items())
        else:
            assert survived.ok, survived.to_dict()
        # ... and catch-up from there restores everything, with no re-bootstrap.
        result = sync(cache, table)
        assert sorted(cache.partitions()) == [DAY1, DAY2, DAY3]
        assert result.reloaded_partitions == []
        for p in (DAY1, DAY2, DAY3):
            expected = truth(table, p, 0)
            probe = list(expected)[:3000] + ["never-inserted"]
            assert cache.lookup(p, probe) == [expected.get(k) for k in probe]
            assert dict(cache.items(p)) == expected
            # The counters too: entries a crash left ahead of the registry were not counted twice.
            assert cache.fills(p) == dict(Counter(expected.values()))
            assert cache.partitions()[p].entries == len(expected)
        assert verify(cache, table).ok
        assert not list(cache.scratch_dir.iterdir())


@pytest.fixture()
def warm(tmp_path):
    table = make_table(tmp_path, num_shards=1, keys_per_day=3000)
    cache = open_cache(table, 0, tmp_path / "cache")
    for p in (DAY1, DAY2, DAY3):
        load_from_snapshot(cache, table, p, table.timeline.latest_seq)
    yield table, cache
    cache.close()


def set_access(cache, partition: str, ms: int) -> None:
    cache.touch(partition, at_ms=ms)


def test_reaper_honours_ttl(warm):
    table, cache = warm
    now = 1_000_000_000_000
    hour = 3600 * 1000
    set_access(cache, DAY1, now - 100 * hour)
    set_access(cache, DAY2, now - 100 * hour)
    set_access(cache, DAY3, now - 1 * hour)
    dry = reap(cache, ttl_hours=72, dry_run=True, now_ms=now)
    assert dry.dropped_ttl == [DAY1, DAY2] and cache.is_ready(DAY1) and cache.is_ready(DAY2)
    result = reap(cache, ttl_hours=72, now_ms=now)
    assert result.dropped_ttl == [DAY1, DAY2] and not cache.is_ready(DAY1) and not cache.is_ready(DAY2)
    assert cache.is_ready(DAY3)
    assert cache.metrics.evictions == 2


@pytest.mark.slow
def test_budget_pass_drops_least_recently_used_first(tmp_path):
    table = make_table(tmp_path, num_shards=1, keys_per_day=150_000)
    with open_cache(table, 0, tmp_path / "cache", compression="none", bloom_bits_per_key=0) as cache:
        for p in (DAY1, DAY2, DAY3):
            load_from_snapshot(cache, table, p, table.timeline.latest_seq)
        cache.flush()
        sizes = {p: cache.disk_bytes(p) for p in (DAY1, DAY2, DAY3)}
        assert min(sizes.values()) > (1 << 20)  # each partition is over a MB, so a MB budget is meaningful
        now = 3_000_000_000_000
        for age, p in enumerate((DAY3, DAY1, DAY2)):
            set_access(cache, p, now - (age + 1) * 1000)
        budget_mb = (cache.disk_bytes() - sizes[DAY2] - sizes[DAY1] // 2) >> 20
        result = reap(cache, ttl_hours=10_000, max_disk_mb=budget_mb, now_ms=now)
        assert result.dropped_budget == [DAY2, DAY1]
        assert cache.is_ready(DAY3) and result.bytes_after <= budget_mb << 20


def test_lookups_loads_and_the_reaper_share_one_cache_across_threads(warm):
    """A tagging thread, a loader and the reaper at once: every answer is complete and right, nothing raises."""
    import threading

    from dbidx.errors import PartitionNotReadyError

    table, cache = warm
    expected = {p: truth(table, p, 0) for p in (DAY1, DAY2)}
    probes = {p: list(expected[p])[::7] + ["absent"] for p in expected}
    stop = threading.Event()
    errors: list[BaseException] = []
    answers = [0]
    rounds = {"loader": 0, "reaper": 0}

    def guarded(fn):
        def run():
            try:
                while not stop.is_set():
                    fn()
            except BaseException as exc:  # noqa: BLE001 - the test reports any failure
                errors.append(exc)
                stop.set()

        return threading.Thread(target=run)

    def tagger():
        for p in (DAY1, DAY2):
            try:
                got = cache.lookup(p, probes[p])
            except PartitionNotReadyError:
                load_from_snapshot(cache, table, p, table.timeline.latest_seq)
                continue
            assert got == [expected[p].get(k) for k in probes[p]]
            answers[0] += 1

    def loader():
        load_from_snapshot(cache, table, DAY1, table.timeline.latest_seq)
        rounds["loader"] += 1

    def reaper():
        set_access(cache, DAY2, 0)
        reap(cache, ttl_hours=1)
        rounds["reaper"] += 1
        time.sleep(0.01)

    threads = [guarded(tagger), guarded(tagger), guarded(loader), guarded(reaper)]
    for t in threads:
        t.start()
    # Run until every role has done its share many times over (not for a fixed window), or something failed.
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        if answers[0] > 50 and min(rounds.values()) > 10:
            break
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert answers[0] > 20


def test_discarding_a_damaged_cache_deletes_only_the_incarnation_that_was_seen(tmp_path: Path) -> None:
    """The task session discards a damaged cache after closing it, so between its close and the discard another
    opener may hold it, or may have discarded and rebuilt it: only the directory incarnation the failing opener
    saw (its lock file's identity) is deleted, and only under its lock; a directory already gone leaves no trace."""
    from dbidx.cache.reaper import discard_cache_dir
    from dbidx.cache.dir_lock import lock_path, release_flock, try_flock

    table = make_table(tmp_path, num_shards=1, keys_per_day=10)
    cache = open_cache(table, 0, tmp_path / "base")
    seen, path = cache.lock_identity, cache.path
    cache.close()
    # 1. Held by another opener: left alone, and the message says what to do if the error comes back.
    fd = try_flock(lock_path(path))
    assert "another opener holds it now" in discard_cache_dir(path, seen) and path.exists()
    release_flock(fd)
    # 2. The seen incarnation, unheld: deleted with its staging dir and lock file.
    assert discard_cache_dir(path, seen).startswith("discarded") and not path.exists()
    assert not lock_path(path).exists()
    # 3. Gone already: nothing created (no stray lock file).
    assert discard_cache_dir(path, seen) == "already discarded by another opener"
    assert not lock_path(path).exists()
    # 4. Rebuilt since (a new lock file incarnation): the healthy rebuild is kept.
    rebuilt = open_cache(table, 0, tmp_path / "base")
    rebuilt.close()
    assert discard_cache_dir(path, seen) == "already discarded by another opener" and path.exists()


def test_only_rocksdb_corruption_is_damage_not_a_path_that_says_so() -> None:
    """RocksDB's status text starts with its code; a path containing the word (or any IO error) is not damage,
    so it never leads a task session to delete a healthy cache."""
    from dbidx.cache.store import read_failure
    from dbidx.errors import CacheCorruptError, CacheError

    damage = read_failure(Exception("Corruption: block checksum mismatch in /x/000011.sst"), "reading")
    io_error = read_failure(
        Exception("IO error: While open a file: /data/Corruption-drills/0001.sst: Too many open files"), "reading"
    )
    assert isinstance(damage, CacheCorruptError)
    assert type(io_error) is CacheError and "Too many open files" in str(io_error)
    # One of the directory's own files gone (CURRENT naming a deleted MANIFEST, a listed SST deleted) is damage;
    # any other missing path is not.
    for own in ("MANIFEST-000005", "000011.sst"):
        gone = read_failure(
            Exception(
                f"IO error: No such file or directory: While opening a file for sequentially "
                f"reading: /c/shard-00000-of-00001/{own}: No such file or directory"
            ),
            "open",
        )
        assert isinstance(gone, CacheCorruptError), own
    other = read_failure(Exception("IO error: No such file or directory: While mkdir: /c/x/LOCK"), "open")
    assert type(other) is CacheError
