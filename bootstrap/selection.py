"""Which partitions make up "the last X days": by the date in their path, else by their last commit time.

The window is X calendar days (UTC) ending with the day of `now`: with now = 2025-01-22 and X = 7 it is
2025-01-16 .. 2025-01-22. A dated partition is in it when its day is on or after the first day (future-dated
partitions count as recent). A partition whose path holds no date (`region=eu`) is in it when its last commit,
from the index partition stats, falls on or after the first day: "the last X days" = written to in the last X days.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from typing import Any, Iterable

from dbidx.bootstrap.partition_dates import compile_pattern, partition_time
from dbidx.errors import InvalidInputError
from dbidx.storage.index_view import PartitionStats

BY_PATH = "path-date"
BY_COMMIT = "last-commit"


@dataclass
class SelectedPartition:
    """A partition chosen for loading, why, and the day that put it in the window."""

    partition: str
    reason: str  # BY_PATH or BY_COMMIT
    day: date
    live_keys: int


@dataclass
class Selection:
    """The window and the partitions in it (newest first: the hottest partitions are loaded first)."""

    now: datetime
    days: int
    first_day: date
    selected: list[SelectedPartition] = field(default_factory=list)
    outside: int = 0

    @property
    def oldest(self) -> str | None:
        """The selected partition with the oldest day (the window's boundary in the data)."""
        return min(self.selected, key=lambda s: (s.day, s.partition)).partition if self.selected else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "now": self.now.isoformat(),
            "days": self.days,
            "first_day": self.first_day.isoformat(),
            "selected": [
                {"partition": s.partition, "reason": s.reason, "day": s.day.isoformat(), "live_keys": s.live_keys}
                for s in self.selected
            ],
            "outside": self.outside,
            "oldest": self.oldest,
        }


def parse_now(value: str | datetime | None) -> datetime:
    """`now` as an aware UTC datetime: None = the clock; a string is an ISO date or date-time."""
    if value is None:
        return datetime.now(timezone.utc)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise InvalidInputError(f"--now {value!r} is not an ISO date or date-time (e.g. 2025-01-22)") from exc
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def select_partitions(
    stats: Iterable[PartitionStats], days: int, now: str | datetime | None = None, pattern: str | None = None
) -> Selection:
    """The partitions of the last `days` days (0 selects none), newest first."""
    if not isinstance(days, int) or days < 0:
        raise InvalidInputError(f"days must be an integer >= 0, got {days!r}")
    if pattern:
        compile_pattern(pattern)  # a bad pattern is an error even when the table is empty
    current = parse_now(now)
    first_day = current.date() - timedelta(days=max(days, 1) - 1)
    selection = Selection(current, days, first_day)
    for stat in stats:
        found = partition_time(stat.partition, pattern)
        if found is not None:
            day, reason = found.day, BY_PATH
        else:
            day, reason = stat.last_commit_time.date(), BY_COMMIT
        if days > 0 and day >= first_day:
            selection.selected.append(SelectedPartition(stat.partition, reason, day, stat.live_keys))
        else:
            selection.outside += 1
    selection.selected.sort(key=lambda s: (s.day, s.partition), reverse=True)
    return selection
