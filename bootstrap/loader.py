"""PartitionLoader: load (cache, partition) slices of the index in parallel, building SSTs in a pool.

Why a split between workers and the owner: reading Parquet and building a sorted SST is CPU work that needs no
RocksDB handle, so it runs in a pool (threads, or spawned processes that escape the GIL); ingesting the finished
file into the cache is a cheap file move done by the thread that owns the open cache. Processes are spawned, never
forked, because forking a process that has a RocksDB open hangs the child (and pyarrow's thread pools).
Measured on 2 cores (benchmarks/bootstrap_bench.py): serial ~1.4-1.5 M entries/s, threads barely better (the
per-entry SST write loop holds the GIL), spawned processes ~1.8-2.5 M entries/s once a load is big enough to pay for
starting them (~0.5 s); the crossover lies between 2 M and 9 M entries (at 2.1 M processes won some early runs
but lost the last two benchmark runs by 5-25 %; at 9 M they win by ~30 %), so "auto" runs serially below 3 M
expected entries and uses processes above.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from dbidx.cache.loading import prepare_slice
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.sst_builder import PreparedLoad
from dbidx.config import CacheConfig
from dbidx.errors import CacheError, InvalidInputError
from dbidx.table.facade import Table
from dbidx.progress import Progress

PARALLELISM = ("auto", "threads", "processes", "serial")
# Below this many entries in one call, "auto" loads serially: a spawned process pool costs ~0.5 s to start, and
# threads lose to serial (measured in benchmarks/bootstrap_bench.py).
PROCESS_THRESHOLD_ENTRIES = 3_000_000


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


def _timed_prepare(
    table: Table, shard: int, partition: str, seq: int, global_mode: bool, sst_path: str, config: CacheConfig
) -> tuple[PreparedLoad, float]:
    started = time.monotonic()
    return prepare_slice(table, shard, partition, seq, global_mode, sst_path, config), started


def choose_parallelism(parallelism: str, expected_entries: int, jobs: int) -> str:
    """Resolve "auto" to serial or processes."""
    if parallelism not in PARALLELISM:
        raise InvalidInputError(f"parallelism must be one of {PARALLELISM}, got {parallelism!r}")
    if parallelism != "auto":
        return parallelism
    if jobs > 1 and expected_entries >= PROCESS_THRESHOLD_ENTRIES and (os.cpu_count() or 1) > 1:
        return "processes"
    return "serial"


class PartitionLoader:
    """Loads many slices at once: builds in a pool, installs in the calling thread as builds finish."""

    def __init__(
        self,
        table: Table,
        parallelism: str = "auto",
        workers: int | None = None,
        progress: Progress | None = None,
        flush_interval_s: float = 1.0,
    ) -> None:
        """flush_interval_s: how often installed partitions are made durable (a flush per partition costs a tiny
        registry SST each; a crash loses at most this much loading progress, never correctness)."""
        choose_parallelism(parallelism, 0, 0)  # validate early
        self.table = table
        self.parallelism = parallelism
        self.workers = workers
        self.progress = progress
        self.used: str = ""
        self._expected = self._done = 0
        self._outcomes: list[LoadOutcome] = []
        self._error: BaseException | None = None
        self.flush_interval_s = flush_interval_s
        self._flushed_at: dict[int, float] = {}

    def load(self, jobs: list[LoadJob]) -> list[LoadOutcome]:
        """Load every job; each partition becomes ready as soon as its own SST is ingested.

        On an error the other jobs still finish (a ready partition is complete on its own), then the first error
        is raised.
        """
        if not jobs:
            return []
        self._expected = sum(j.expected_entries for j in jobs)
        self._done, self._outcomes, self._error = 0, [], None
        self.used = mode = choose_parallelism(self.parallelism, self._expected, len(jobs))
        if mode == "serial":  # build and install one slice at a time, in order
            for job in jobs:
                sst = self._sst_path(job)
                self._install(partial(_timed_prepare, *self._args(job, sst)), job, sst)
        else:
            workers = self.workers or min(len(jobs), max(2, os.cpu_count() or 2) if mode == "processes" else 8)
            pool: Executor = (
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dbidx-load")
                if mode == "threads"
                else ProcessPoolExecutor(
                    max_workers=min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")
                )
            )
            try:
                futures: dict[Future, tuple[LoadJob, str]] = {}
                for job in jobs:
                    sst = self._sst_path(job)
                    futures[pool.submit(_timed_prepare, *self._args(job, sst))] = (job, sst)
                for future in as_completed(futures):
                    self._install(future.result, *futures[future])
            finally:
                pool.shutdown(wait=True, cancel_futures=self._error is not None)
        for cache in {id(j.cache): j.cache for j in jobs}.values():
            cache.flush()
        if self._error is not None:
            raise self._error
        return self._outcomes

    def _args(self, job: LoadJob, sst: str) -> tuple:
        return (
            self.table,
            job.cache.shard,
            job.partition,
            job.seq,
            job.cache.global_mode,
            sst,
            job.cache.config,
        )

    @staticmethod
    def _sst_path(job: LoadJob) -> str:
        return str(job.cache.scratch_dir / f"load-{uuid.uuid4().hex[:12]}.sst")

    def _install(self, built: Callable[[], tuple[PreparedLoad, float]], job: LoadJob, sst: str) -> None:
        """Ingest one build (`built()` runs it, or returns a pool's finished result) into its cache and report
        progress; remember the first error, whether the build or the install raised it."""
        try:
            prepared, started = built()
            job.cache.install_partition(prepared, job.seq, durable=False)
            now = time.monotonic()
            if now - self._flushed_at.setdefault(id(job.cache), now) >= self.flush_interval_s:
                job.cache.flush()
                self._flushed_at[id(job.cache)] = now
        except BrokenProcessPool:
            Path(sst).unlink(missing_ok=True)
            self._error = self._error or CacheError(
                f"a bootstrap worker process died while building partition {job.partition!r} of shard "
                f"{job.cache.shard} (out of memory? or a script that starts a load without an "
                "`if __name__ == '__main__':` guard, which spawned workers re-run); parallelism='threads' avoids "
                "worker processes"
            )
            return
        except BaseException as exc:  # noqa: BLE001 - the other slices still finish; the first error is raised
            Path(sst).unlink(missing_ok=True)
            self._error = self._error or exc
            return
        self._outcomes.append(
            LoadOutcome(job.cache.shard, job.partition, prepared.entries, prepared.seconds, started, time.monotonic())
        )
        self._done += prepared.entries
        if self.progress is not None:
            self.progress(
                self._done,
                max(self._expected, self._done),
                f"shard {job.cache.shard} {job.partition or '(global)'}",
                self._done,
            )
