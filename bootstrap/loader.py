"""PartitionLoader: load (cache, partition) slices of the MDT in parallel, building SSTs in a pool.

Why a split between workers and the owner: reading Parquet and building a sorted SST is CPU work that needs no
RocksDB handle, so it runs in a pool (threads, or spawned processes that escape the GIL); ingesting the finished
file into the cache is a cheap file move done by the thread that owns the open cache. Processes are spawned, never
forked, because forking a process that has a RocksDB open hangs the child (and pyarrow's thread pools).
Measured trade-off (benchmarks/bootstrap_bench.py): processes win on big loads, threads on small ones where
spawning the pool (~1 s of imports) would dominate; "auto" picks by the expected number of entries.
"""
from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dbidx.cache.catchup import snapshot_entries
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.sst_builder import PreparedLoad, build_sst
from dbidx.config import CacheConfig
from dbidx.errors import CacheError, InvalidInputError
from dbidx.mdt.table import Table

PARALLELISM = ("auto", "threads", "processes", "serial")
# Below this many entries in one call, "auto" uses threads: a spawned process pool costs ~1 s to start.
PROCESS_THRESHOLD_ENTRIES = 1_500_000

ProgressCallback = Callable[[int, int, str], None]  # (entries done, entries expected, label of what finished)


@dataclass
class LoadJob:
    """One slice to load: a partition of the shard a cache holds, as of a completion seq."""

    cache: RecordIndexCache
    partition: str
    seq: int
    expected_entries: int = 0


@dataclass
class LoadOutcome:
    """What loading one slice did, with wall-clock start and end (for stall and concurrency reporting)."""

    shard: int
    partition: str
    entries: int
    build_seconds: float
    started: float  # time.monotonic() when the build began
    finished: float  # time.monotonic() when the partition became ready


def prepare_slice(table: Table, shard: int, partition: str, seq: int, global_mode: bool, sst_path: str,
                  config: CacheConfig) -> PreparedLoad:
    """Read one shard's slice of a partition from the MDT and write it as an SST (runs in a pool worker)."""
    keys, locations = snapshot_entries(table, shard, partition, seq, global_mode)
    return build_sst(partition, keys, locations, sst_path, config)


def _timed_prepare(table: Table, shard: int, partition: str, seq: int, global_mode: bool, sst_path: str,
                   config: CacheConfig) -> tuple[PreparedLoad, float]:
    started = time.monotonic()
    return prepare_slice(table, shard, partition, seq, global_mode, sst_path, config), started


def choose_parallelism(parallelism: str, expected_entries: int, jobs: int) -> str:
    """Resolve "auto" to threads or processes (serial for a single small job)."""
    if parallelism not in PARALLELISM:
        raise InvalidInputError(f"parallelism must be one of {PARALLELISM}, got {parallelism!r}")
    if parallelism != "auto":
        return parallelism
    if jobs <= 1:
        return "serial"
    if expected_entries >= PROCESS_THRESHOLD_ENTRIES and (os.cpu_count() or 1) > 1:
        return "processes"
    return "threads"


class PartitionLoader:
    """Loads many slices at once: builds in a pool, installs in the calling thread as builds finish."""

    def __init__(self, table: Table, parallelism: str = "auto", workers: int | None = None,
                 progress: ProgressCallback | None = None) -> None:
        choose_parallelism(parallelism, 0, 0)  # validate early
        self.table = table
        self.parallelism = parallelism
        self.workers = workers
        self.progress = progress
        self.used: str = ""

    def load(self, jobs: list[LoadJob]) -> list[LoadOutcome]:
        """Load every job; each partition becomes ready as soon as its own SST is ingested.

        On an error the other jobs still finish (a ready partition is complete on its own), then the first error
        is raised.
        """
        if not jobs:
            return []
        expected = sum(j.expected_entries for j in jobs)
        self.used = mode = choose_parallelism(self.parallelism, expected, len(jobs))
        workers = self.workers or min(len(jobs), max(2, os.cpu_count() or 2) if mode == "processes" else 8)
        outcomes: list[LoadOutcome] = []
        done_entries = 0
        first_error: BaseException | None = None
        if mode == "serial":
            pool: Executor | None = None
        elif mode == "threads":
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dbidx-load")
        else:
            pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                                       mp_context=multiprocessing.get_context("spawn"))
        try:
            futures: dict[Future, tuple[LoadJob, str]] = {}
            for job in jobs:
                sst = str(job.cache.scratch_dir / f"load-{uuid.uuid4().hex[:12]}.sst")
                args = (self.table, job.cache.identity.shard, job.partition, job.seq, job.cache.global_mode, sst,
                        job.cache.config)
                if pool is None:
                    future: Future = Future()
                    try:
                        future.set_result(_timed_prepare(*args))
                    except BaseException as exc:  # noqa: BLE001 - reported below like a pool failure
                        future.set_exception(exc)
                else:
                    future = pool.submit(_timed_prepare, *args)
                futures[future] = (job, sst)
            for future in as_completed(futures):
                job, sst = futures[future]
                try:
                    prepared, started = future.result()
                    job.cache.install_partition(prepared, job.seq)
                except BrokenProcessPool as exc:
                    Path(sst).unlink(missing_ok=True)
                    first_error = first_error or CacheError(
                        f"a bootstrap worker process died while building partition {job.partition!r} of shard "
                        f"{job.cache.identity.shard} (out of memory? or a script that starts a load without an "
                        "`if __name__ == '__main__':` guard, which spawned workers re-run); parallelism='threads' "
                        "avoids worker processes")
                    first_error.__cause__ = None
                    continue
                except BaseException as exc:  # noqa: BLE001
                    Path(sst).unlink(missing_ok=True)
                    first_error = first_error or exc
                    continue
                outcomes.append(LoadOutcome(job.cache.identity.shard, job.partition, prepared.entries,
                                            prepared.seconds, started, time.monotonic()))
                done_entries += prepared.entries
                if self.progress is not None:
                    self.progress(done_entries, max(expected, done_entries),
                                  f"shard {job.cache.identity.shard} {job.partition or '(global)'}")
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=first_error is not None)
        if first_error is not None:
            raise first_error
        return outcomes

