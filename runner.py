"""Where a service's independent pieces of work run: in this process, or as one Spark job (pieces packed into a task
per core).

Data compaction rewrites file groups and index compaction merges (partition, shard) groups, each piece on its own;
only the publish that follows needs the driver. A `WorkRunner` runs the pieces: `IN_PROCESS` here, a few at once
on threads, `dbidx.spark_integration.service_jobs.SparkWorkRunner` as a Spark job, so a Spark writer's services use the
cluster's cores and memory instead of the driver's.

The contract, the same for every runner:
- `work(item, attempt)` runs a piece and returns bytes (msgpack): what the driver receives is parsed strictly by
  the caller, never unpickled, as task results of an upsert are. `attempt` numbers the try (0 first): a piece run
  again (a retried or speculative Spark task) writes under another name and announces it with a marker first, so
  attempts never overwrite each other's files and the losers' files are deleted after the publish.
- `weights` (e.g. bytes to read per item) let a runner balance its tasks.
- results come back in the order of `items`, one per item, of the attempt the runner kept (the one that reported).
- an error in a piece is raised by `run` as its own dbidx type where it can be (Spark: from the task's traceback).
- `work` and the items must pickle when the runner is Spark: a module-level function bound with functools.partial.
- a caller reads the results inside `results_of(...)`, so pieces still running stop before its rollback runs.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Protocol, Sequence

import msgpack

from dbidx.errors import CommitError

Work = Callable[[Any, int], bytes]


class SizedStorage(Protocol):
    """What check_written needs of a FileIO (dbidx.storage.fileio; this module sits below it)."""

    def sizes(self, rels: list[str]) -> dict[str, int]: ...

    def path(self, rel: str) -> str: ...


class WorkRunner(Protocol):
    """Runs independent pieces of a service's work and returns their results in order."""

    where: str  # "driver" or "spark": reported with each service run

    def run(
        self, work: Work, items: Sequence[Any], what: str, weights: Sequence[int] | None = None
    ) -> Iterator[bytes]: ...


MAX_THREADS = 4  # pieces run at once in this process: each holds its file group's rows in memory


class InProcessRunner:
    """Runs the pieces in this process (attempt 0 each), a few at once on threads, results in order as each is
    reached: a caller reports progress as pieces finish.

    Why threads: a compaction in the driver used one core while the executors' cores sat idle (the services run
    after the upsert's job), and most of a piece's time is Parquet decoding and encoding, zstd and numpy, which let go
    of the GIL. Measured on 2 cores (benchmarks/RESULTS.md, speed sections): the services after the ninth batch into
    a 2 M-key table (four data compaction rounds, an index compaction) took 2.5-2.9 s on 2 threads against 3.3-3.7 s
    one piece at a time. At most `threads` pieces (and their rows) are in memory at once. When a piece fails, the
    pieces not yet started are cancelled and the running ones finish before the first failure (in item order) is
    raised, so no piece writes behind the caller's rollback; the same when the caller stops reading early.
    """

    where = "driver"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads if threads is not None else min(MAX_THREADS, _cores()))

    def run(self, work: Work, items: Sequence[Any], what: str, weights: Sequence[int] | None = None) -> Iterator[bytes]:
        """Each item's result, in order (`weights` only matter to runners that spread the work)."""
        if self.threads == 1 or len(items) <= 1:
            for item in items:
                yield work(item, 0)
            return
        stop = threading.Event()  # set by the first failure (or an early stop): no piece starts after it

        def guarded(item: Any) -> bytes:
            if stop.is_set():
                raise _NotStarted()
            try:
                return work(item, 0)
            except BaseException:
                stop.set()
                raise

        pool = ThreadPoolExecutor(max_workers=min(self.threads, len(items)), thread_name_prefix="dbidx-piece")
        futures: list[Future[bytes]] = []
        try:
            futures.extend(pool.submit(guarded, item) for item in items)  # a submit that fails: what ran is waited for
            for future in futures:
                error = future.exception()  # every earlier piece succeeded: this is the first failure in item order
                if error is not None:
                    raise error  # the piece's own error, its cause kept, once the `finally` waited for the rest
                yield future.result()
        finally:
            # A failure or an early stop: nothing more starts, and what runs finishes before the caller goes on.
            stop.set()
            _end(pool, futures)


@contextmanager
def results_of(results: Iterator[bytes]) -> Iterator[Iterator[bytes]]:
    """Use a runner's results inside a block that stops its pieces when it ends (a caller that fails on one result
    must not leave pieces writing behind its rollback: the in-process runner waits for its running ones)."""
    try:
        yield results
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _NotStarted(Exception):
    """A piece skipped because an earlier one failed (or the caller stopped): never what the caller sees."""


def _end(pool: ThreadPoolExecutor, futures: list[Future[bytes]]) -> None:
    """Cancel the pieces not started and wait for the running ones."""
    for future in futures:
        future.cancel()
    pool.shutdown(wait=True)


IN_PROCESS = InProcessRunner()


def pack(result: dict[str, Any]) -> bytes:
    """A piece's result as the bytes a runner hands back (msgpack)."""
    return msgpack.packb(result, use_bin_type=True)


def unpack(payload: object, where: str, fields: set[str]) -> dict[str, Any]:
    """A piece's result, decoded and checked to be a map of exactly `fields` (CommitError otherwise: nothing is
    published on a result the driver cannot read)."""
    try:
        if not isinstance(payload, (bytes, bytearray)):
            raise ValueError(f"a {type(payload).__name__}, not bytes")
        result = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        if not isinstance(result, dict) or set(result) != fields:
            raise ValueError(
                f"fields {sorted(result) if isinstance(result, dict) else type(result).__name__}, "
                f"expected {sorted(fields)}"
            )
    except (ValueError, msgpack.UnpackException) as exc:
        raise CommitError(
            f"{where}: a piece of work returned a malformed result ({exc}); nothing was published"
        ) from exc
    return result


def attempt_of(result: dict[str, Any]) -> int:
    """A result's `attempt`, a whole number >= 0 (ValueError otherwise: the caller names the piece)."""
    attempt = result["attempt"]
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt {attempt!r} is not a whole number >= 0")
    return attempt


def check_written(io: SizedStorage, what: str, expected: list[tuple[str, int]]) -> None:
    """Every file pieces of work reported must exist with the size they reported (one `FileIO.sizes` call: a request
    per file on an object store): CommitError naming the first that does not, before anything is published."""
    sizes = io.sizes([rel for rel, _ in expected])
    wrong = [(rel, size, sizes.get(rel)) for rel, size in expected if sizes.get(rel) != size]
    if wrong:
        rel, size, found = wrong[0]
        raise CommitError(
            f"{what}: {len(wrong)} file(s) the tasks listed are missing or have another "
            f"size, e.g. {io.path(rel)} ({size} bytes reported, "
            f"{'missing' if found is None else f'{found} found'}); nothing was published"
        )


class BySize:
    """Runs work weighing at least `min_weight` (bytes to read) with `large`, lighter work with `small`: a Spark job
    has a fixed cost (scheduling, Python workers: about half a second on a 2-core machine) that small work does not win
    back, while large work gains the cluster's cores and spares the driver's memory. `where` says where the last
    run went (read by the caller after it)."""

    def __init__(self, large: WorkRunner, min_weight: int, small: WorkRunner = IN_PROCESS) -> None:
        self.large, self.small, self.min_weight = large, small, min_weight
        self.where = small.where if min_weight > 0 else large.where

    def run(self, work: Work, items: Sequence[Any], what: str, weights: Sequence[int] | None = None) -> Iterator[bytes]:
        """The items' results from the runner their total weight chooses (unweighted work goes to `large`)."""
        runner = self.large if weights is None or sum(weights) >= self.min_weight else self.small
        self.where = runner.where
        return runner.run(work, items, what, weights)
