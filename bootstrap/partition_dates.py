"""Recognise the date (or hour) a partition path stands for: `dt=2025-01-15`, `2025/01/15`, `date=20250115`, ...

Pure functions, no I/O. A path may hold its date anywhere among other levels (`region=eu/dt=2025-01-15/hr=07`);
the first date found, reading left to right, wins. A path without one returns None, and the bootstrap then counts
the partition by its last commit time instead (RFC-107's review comment on non-date partitions).

Built-in forms (the `key=` part is optional and any key is accepted, so `dt=`, `date=`, `day=`, `ds=` all work):
  [key=]YYYY-MM-DD            optional hour: `-HH`, `THH`, `_HH`, ` HH`, or a next level `[hour|hr|hh|h=]HH`
  [key=]YYYYMMDD[HH]          optional hour: a next level `[hour|hr|hh|h=]HH`
  YYYY/MM/DD[/HH]             bare numeric levels
  year=YYYY/month=MM/day=DD[/hour=HH]   (also y/m/d/h, yyyy/mm/dd/hh)
A user pattern is either strftime-like (`%Y`, `%m`, `%d`, `%H`, `%j` and literal text, e.g. `ds=%Y%m%d`) or a
regular expression with named groups `year`, `month`, `day` and optionally `hour` (prefix `re:`), matched at
level boundaries. Numbers must make a real calendar date with a year in 1900..2199, so `id=12345678` is no date.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from functools import lru_cache

from dbidx.errors import ConfigError

_HOUR_KEY = r"(?:hour|hr|hh|h)="
_LEVEL_START = r"(?:^|/)"
_LEVEL_END = r"(?=/|$)"
_NEXT_HOUR = rf"(?:/(?:{_HOUR_KEY})?(?P<hour2>\d{{2}}))?"

_BUILT_IN = [
    re.compile(
        rf"{_LEVEL_START}(?:year|yyyy|y)=(?P<year>\d{{4}})/(?:month|mm|m)=(?P<month>\d{{1,2}})/"
        rf"(?:day|dd|d)=(?P<day>\d{{1,2}})(?:/{_HOUR_KEY}(?P<hour>\d{{1,2}}))?{_LEVEL_END}",
        re.I,
    ),
    re.compile(
        rf"{_LEVEL_START}(?:[^/=]+=)?(?P<year>\d{{4}})-(?P<month>\d{{2}})-(?P<day>\d{{2}})"
        rf"(?:[-T_ ](?P<hour>\d{{2}}))?{_LEVEL_END}{_NEXT_HOUR}{_LEVEL_END}",
        re.I,
    ),
    re.compile(
        rf"{_LEVEL_START}(?:[^/=]+=)?(?P<year>\d{{4}})(?P<month>\d{{2}})(?P<day>\d{{2}})(?P<hour>\d{{2}})?"
        rf"{_LEVEL_END}{_NEXT_HOUR}{_LEVEL_END}",
        re.I,
    ),
    re.compile(
        rf"{_LEVEL_START}(?P<year>\d{{4}})/(?P<month>\d{{2}})/(?P<day>\d{{2}})(?:/(?P<hour>\d{{2}}))?"
        rf"{_LEVEL_END}"
    ),
]

_STRFTIME = {
    "%Y": r"(?P<year>\d{4})",
    "%m": r"(?P<month>\d{1,2})",
    "%d": r"(?P<day>\d{1,2})",
    "%H": r"(?P<hour>\d{1,2})",
    "%j": r"(?P<yday>\d{3})",
    "%%": "%",
}


@dataclass(frozen=True)
class PartitionTime:
    """The time span a partition path stands for (UTC): a day or an hour."""

    start: datetime
    granularity: str  # "day" or "hour"

    @property
    def day(self) -> date:
        """The calendar day the partition belongs to."""
        return self.start.date()


@lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A user pattern (strftime-like, or `re:` + regex with named groups) as a regex anchored at path levels."""
    if pattern.startswith("re:"):
        body = pattern[3:]
    else:
        body, i = "", 0
        while i < len(pattern):
            token = pattern[i : i + 2]
            if token in _STRFTIME:
                body += _STRFTIME[token]
                i += 2
            elif pattern[i] == "%":
                raise ConfigError(
                    f"partition pattern {pattern!r}: {token!r} is not supported; use %Y %m %d %H %j "
                    "or a regex with named groups (prefix 're:')"
                )
            else:
                body += re.escape(pattern[i])
                i += 1
    try:
        compiled = re.compile(rf"{_LEVEL_START}(?:{body}){_LEVEL_END}")
    except re.error as exc:
        raise ConfigError(f"partition pattern {pattern!r} is not a valid regex: {exc}") from exc
    groups = set(compiled.groupindex)
    if not ({"year", "month", "day"} <= groups or {"year", "yday"} <= groups):
        raise ConfigError(
            f"partition pattern {pattern!r} must capture a year, month and day (%Y %m %d, or named "
            "groups year/month/day in a regex)"
        )
    return compiled


def _to_time(groups: dict[str, str | None]) -> PartitionTime | None:
    """A PartitionTime from matched groups, or None when the numbers are not a real date and hour."""
    try:
        year = int(groups["year"] or 0)
        if not 1900 <= year <= 2199:
            return None
        if groups.get("yday"):
            day = date(year, 1, 1) + timedelta(days=int(groups["yday"] or 0) - 1)
            if day.year != year:
                return None
        else:
            day = date(year, int(groups["month"] or 0), int(groups["day"] or 0))
        hour_text = groups.get("hour") or groups.get("hour2")
        start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
        if hour_text is None:
            return PartitionTime(start, "day")
        hour = int(hour_text)
        if not 0 <= hour <= 23:
            return None
        return PartitionTime(start.replace(hour=hour), "hour")
    except ValueError:
        return None


def partition_time(partition: str, pattern: str | None = None) -> PartitionTime | None:
    """The day or hour a partition path stands for, or None if its path holds no date.

    With a user pattern only that pattern is tried (a table whose paths need a pattern should not also be read
    by the built-in guesses).
    """
    candidates = [compile_pattern(pattern)] if pattern else _BUILT_IN
    best: tuple[int, PartitionTime] | None = None
    for regex in candidates:
        for match in regex.finditer(partition):
            found = _to_time(match.groupdict())
            if found is not None:
                if best is None or match.start() < best[0]:
                    best = (match.start(), found)
                break
    return None if best is None else best[1]
