"""Unfinished attempts: instants that were started and neither completed nor rolled back, with what an operator
needs to decide about them (who started them, when, whether their writer still runs, which files they wrote).

Whether the writer runs: its heartbeat (storage/heartbeat.py) says so on any host: renewed within its expiry, it is
alive; expired, the attempt is abandoned. Without a heartbeat (its writer died between its claim and its first beat,
or was of a dbidx before heartbeats) the pid says so on the writer's own host, and elsewhere an attempt older than a
heartbeat's expiry counts as abandoned. The next upsert rolls abandoned attempts back (`clean_abandoned`), and
`dbidx rollback --all-pending` skips live ones unless `--force`. Everything here is read back from storage: a claim
or heartbeat file that is not what dbidx writes is shown as unknown, never trusted.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from dbidx.errors import DbidxError, InstantStateError
from dbidx.storage import layout, markers
from dbidx.storage.fileio import FileIO
from dbidx.storage.heartbeat import DEFAULT_INTERVAL_S, EXPIRY_INTERVALS, read_heartbeat


@dataclass(frozen=True)
class PendingAttempt:
    """One unfinished instant: its claim (action, host, pid, start time), its files, and whether it is alive."""

    instant: str
    action: str | None
    host: str | None
    pid: int | None
    started_at_ms: int | None
    age_seconds: float | None
    alive: bool | None  # by its heartbeat (or pid on this host); None while that cannot be known yet
    staged: bool  # its record is staged: its Delta version may be on storage (then it committed)
    files: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)  # what else the writer said of itself (Spark application id)
    heartbeat_age_seconds: float | None = None  # since its writer last renewed its heartbeat (None: it has none)
    heartbeat_expires_in_seconds: float | None = None  # until it counts as abandoned if not renewed

    @property
    def abandoned(self) -> bool:
        """Its writer is provably gone: the next upsert (or `rollback --all-pending`) rolls it back."""
        return self.alive is False

    @property
    def advice(self) -> str:
        """What to run about it."""
        if self.alive:
            return "its writer is running (heartbeat renewed or pid alive on this host): leave it"
        if self.staged:
            return "its record is staged: `dbidx sync URI` publishes it if its Delta version is on storage"
        if self.abandoned:
            return (
                f"its writer is gone: the next upsert rolls it back, or `dbidx rollback URI {self.instant}` "
                "(or `--all-pending`) now"
            )
        return (
            f"its writer started moments ago and has no heartbeat yet; if it is gone, `dbidx rollback URI "
            f"{self.instant}`"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form, with the advice."""
        return asdict(self) | {"advice": self.advice}


def pending_attempts(io: FileIO, timeline: Any, with_files: bool = True) -> list[PendingAttempt]:
    """Every pending instant of the table, oldest first (with_files=False: without the files each wrote, which
    costs a listing and a request per file)."""
    now_ms = time.time() * 1000
    out = []
    for instant in sorted(timeline.pending()):
        claim = _claim(io, instant)
        started = claim.get("started_at_ms")
        started = started if isinstance(started, int) and not isinstance(started, bool) else None
        pid = claim.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        host = claim.get("host") if isinstance(claim.get("host"), str) else None
        files = (
            sorted(
                set(_listed(lambda: timeline.planned_files(instant)))
                | set(_listed(lambda: markers.announced_files(io, instant)))
            )
            if with_files
            else []
        )
        raw_tags = claim.get("tags")
        tags = raw_tags if isinstance(raw_tags, dict) else {}
        age = None if started is None else round(max(0.0, (now_ms - started) / 1000), 1)
        beat = read_heartbeat(io, instant, now_ms)
        out.append(
            PendingAttempt(
                instant=instant,
                action=claim.get("action") if isinstance(claim.get("action"), str) else None,
                host=host,
                pid=pid,
                started_at_ms=started,
                age_seconds=age,
                alive=_alive(host, pid, beat, age),
                staged=io.exists(layout.staged_file(instant)),
                files=[f for f in files if io.exists(f)],
                tags={k: v for k, v in tags.items() if isinstance(k, str) and isinstance(v, str)},
                heartbeat_age_seconds=None if beat is None else beat.age_seconds,
                heartbeat_expires_in_seconds=None if beat is None else beat.expires_in_seconds,
            )
        )
    return out


@dataclass
class AbandonedReport:
    """What a writer found of other unfinished attempts before it started, and which of them it rolled back."""

    seen: int = 0
    rolled_back: list[str] = field(default_factory=list)  # abandoned: heartbeat expired, or pid gone on this host
    running: list[str] = field(default_factory=list)  # alive, or too young to tell: left to their writers
    settled: list[str] = field(default_factory=list)  # completed or rolled back by another process meanwhile
    failed: list[str] = field(default_factory=list)  # the rollback failed (a warning says why): tried again next time

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def roll_back_abandoned(timeline: Any, attempts: list[PendingAttempt]) -> AbandonedReport:
    """Roll back every abandoned attempt (their writers are gone); never raises for one that cannot be: what a
    writer does before its own work is housekeeping, and the attempt stays for the next writer or the operator."""
    report = AbandonedReport(seen=len(attempts))
    dead = [a.instant for a in attempts if a.abandoned]
    report.running = [a.instant for a in attempts if not a.abandoned]
    for instant in dead:
        try:
            record = timeline.rollback(instant, ignore=dead)
        except InstantStateError:
            report.settled.append(instant)  # its Delta version was on storage (it committed), or it is gone
            continue
        except (DbidxError, OSError) as exc:
            warnings.warn(
                f"abandoned instant {instant} could not be rolled back ({type(exc).__name__}: {exc}); "
                "it is tried again by the next writer, or run `dbidx rollback URI --all-pending`",
                RuntimeWarning,
                stacklevel=2,
            )
            report.failed.append(instant)
            continue
        (report.rolled_back if record.rolled_back == instant else report.settled).append(instant)
    return report


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


def _alive(host: str | None, pid: int | None, beat: Any, age: float | None) -> bool | None:
    """Whether the writer still runs. 1. A pid on this host that is gone: no. 2. A heartbeat: renewed within its
    expiry (yes) or not (no, even if a process of that pid runs: a reused pid, or a writer stalled for minutes).
    3. No heartbeat: the pid on this host, elsewhere an attempt older than a heartbeat's expiry is gone."""
    local = _pid_alive(pid) if host is not None and host == socket.gethostname() else None
    if local is False:
        return False
    if beat is not None:
        return not beat.expired
    if local is not None:
        return local
    if age is not None and age > EXPIRY_INTERVALS * DEFAULT_INTERVAL_S:
        return False
    return None


def _pid_alive(pid: int | None) -> bool | None:
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process of that pid exists
    return True
