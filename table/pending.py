"""Unfinished attempts: instants that were started and neither completed nor rolled back, with what an operator
needs to decide about them (who started them, when, whether that process still runs, which files they wrote).

Why this is shown and not cleaned by itself: a pending instant is a live writer's or a dead one's, and only its
writer's liveness tells them apart. A writer on this host can be checked (its pid); one elsewhere cannot, so
`dbidx rollback --all-pending` skips writers provably alive and says so, and the rest is the operator's call.
Everything here is read back from storage: a claim file that is not what dbidx writes is shown as unreadable,
never trusted.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dbidx.errors import DbidxError
from dbidx.table import layout, markers
from dbidx.table.fileio import FileIO


@dataclass(frozen=True)
class PendingAttempt:
    """One unfinished instant: its claim (action, host, pid, start time), its files, and whether it is alive."""

    instant: str
    action: str | None
    host: str | None
    pid: int | None
    started_at_ms: int | None
    age_seconds: float | None
    alive: bool | None  # True/False for a writer on this host, None when that cannot be known here
    staged: bool  # its record is staged: its Delta version may be on storage (then it committed)
    files: list[str] = field(default_factory=list)

    @property
    def advice(self) -> str:
        """What to run about it."""
        if self.alive:
            return "its writer (pid on this host) is running: leave it"
        if self.staged:
            return "its record is staged: `dbidx sync URI` publishes it if its Delta version is on storage"
        return f"if its writer is gone: `dbidx rollback URI {self.instant}` (or `--all-pending`)"

    def to_dict(self) -> dict[str, Any]:
        """JSON form, with the advice."""
        return asdict(self) | {"advice": self.advice}


def pending_attempts(io: FileIO, timeline: Any) -> list[PendingAttempt]:
    """Every pending instant of the table, oldest first."""
    now_ms = time.time() * 1000
    out = []
    for instant in sorted(timeline.pending()):
        claim = _claim(io, instant)
        started = claim.get("started_at_ms")
        started = started if isinstance(started, int) and not isinstance(started, bool) else None
        pid = claim.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        host = claim.get("host") if isinstance(claim.get("host"), str) else None
        files = sorted(set(_listed(lambda: timeline.planned_files(instant)))
                       | set(_listed(lambda: markers.announced_files(io, instant))))
        out.append(PendingAttempt(
            instant=instant, action=claim.get("action") if isinstance(claim.get("action"), str) else None,
            host=host, pid=pid, started_at_ms=started,
            age_seconds=None if started is None else round(max(0.0, (now_ms - started) / 1000), 1),
            alive=_alive(host, pid), staged=io.exists(layout.staged_file(instant)),
            files=[f for f in files if io.exists(f)]))
    return out


def _listed(read: Any) -> list[str]:
    """An instant's plan or markers; a damaged one lists nothing here (`dbidx verify` and the rollback name it)."""
    try:
        return list(read())
    except DbidxError:
        return []


def _claim(io: FileIO, instant: str) -> dict[str, Any]:
    try:
        data = json.loads(io.read_bytes(layout.requested_file(instant)))
    except (ValueError, OSError, DbidxError):  # gone meanwhile, or not what dbidx writes: shown as unknown
        return {}
    return data if isinstance(data, dict) else {}


def _alive(host: str | None, pid: int | None) -> bool | None:
    """Whether the writer process still runs: known only for this host (a pid elsewhere says nothing here)."""
    if host is None or pid is None or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process of that pid exists
    return True
