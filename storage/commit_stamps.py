"""Delta's in-commit timestamps (PROTOCOL.md "In-Commit Timestamps") as the data view keeps them: the stamp of the
newest version, so that the stamp of dbidx's next version is a function of the completion log alone.

Why in the view and not read from the previous version on storage: a Delta version is derived again, and compared
byte for byte, whenever a process finds it unconfirmed (data/delta_log.py), and by then Delta's log cleanup may have
deleted the version before it; a stamp read from storage would then differ from the one written (and the writer's
clock may have been behind the previous stamp). The view folds the stamp instead: dbidx's own versions as the rule
gives them (the larger of the commit's time and one millisecond after the previous stamp), another engine's as the
absorb record (or the adoption) read it from that engine's commitInfo.
"""

from __future__ import annotations

from typing import Any, Mapping

from dbidx.errors import CorruptFileError

IN_COMMIT_TIMESTAMPS = "delta.enableInCommitTimestamps"
# The extra of an absorb record (the stamp of its run's newest version) and of an adopting build-index (the stamp of
# the adopted version), when that version has one.
STAMP_EXTRA = "in_commit_timestamp"


def stamps_on(configuration: Mapping[str, Any]) -> bool:
    """The table's properties turn in-commit timestamps on: every commit carries one."""
    return str(configuration.get(IN_COMMIT_TIMESTAMPS, "")).lower() == "true"


def next_stamp(attempted_ms: int, previous: int | None) -> int:
    """The larger of the time the commit was attempted and one millisecond after the previous commit's stamp."""
    return attempted_ms if previous is None else max(attempted_ms, previous + 1)


def valid_stamp(value: Any) -> int | None:
    """`value` if it is a stamp (a non-negative integer of milliseconds), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def stamp_of(value: Any, where: str) -> int:
    """A recorded stamp, read back: a non-negative integer or a CorruptFileError naming where."""
    stamp = valid_stamp(value)
    if stamp is None:
        raise CorruptFileError(f"{where}: its {STAMP_EXTRA} {value!r} is not a timestamp")
    return stamp
