"""Progress of long work: the one callback type every long-running library call takes as `progress=`.

upsert / upsert_arrow (per shard), bootstrap (per partition slice), build-index (per data file), index and data
compaction (per group), upgrade (per file group) and table verification (per file) call it after each step they
finish. The default is `null_progress`: nothing is reported and nothing is measured. The CLI shows the calls as a
progress bar on a terminal, or as throttled log lines on stderr (cli_output.ProgressBar); never on stdout.

A callback is any callable `progress(done, total, step, rows)`:
- `done`, `total`: steps finished so far and steps expected, in the work's own unit (files, shards, slices, groups;
  bootstrap counts entries). `done <= total` always; the last call has `done == total`.
- `step`: what just finished, for a human (`"dt=2025-01-10 shard 3"`).
- `rows`: rows (keys, entries) processed so far, all steps together; 0 when the work does not count rows. A display
  divides it by the time since the first call for rows/s.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """A receiver of progress: called after each finished step of long work."""

    def __call__(self, done: int, total: int, step: str = "", rows: int = 0) -> None: ...


def null_progress(done: int, total: int, step: str = "", rows: int = 0) -> None:
    """The default receiver: does nothing."""


class Steps:
    """Counts the steps and rows of one piece of work and reports each finished step to a Progress."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress or null_progress
        self.total, self.done, self.rows = total, 0, 0

    def step(self, what: str, rows: int = 0) -> None:
        """One more step finished, having processed `rows` more rows."""
        self.done += 1
        self.rows += rows
        self.progress(self.done, max(self.total, self.done), what, self.rows)
