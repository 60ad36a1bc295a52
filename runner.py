"""Where a service's independent pieces of work run: in this process, or as one Spark job (pieces packed into a task
per core).

Data compaction rewrites file groups and index compaction merges (partition, shard) groups, each piece on its own;
only the publish that follows needs the driver. A `WorkRunner` runs the pieces: `IN_PROCESS` one after another
here, `dbidx.spark_integration.service_jobs.SparkWorkRunner` as a Spark job, so a Spark writer's services use the
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
"""

from __future__ import annotations

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


class InProcessRunner:
    """Runs the pieces one after another in this process (attempt 0 each): lazily, so a caller reports progress
    as each piece finishes."""

    where = "driver"

    def run(self, work: Work, items: Sequence[Any], what: str, weights: Sequence[int] | None = None) -> Iterator[bytes]:
        """Each item's result, in order, as it finishes (`weights` only matter to runners that spread the work)."""
        for item in items:
            yield work(item, 0)


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
