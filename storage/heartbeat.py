"""Writer heartbeats: how any process tells a running instant from an abandoned one, on any host.

Why: a `.requested` instant whose writer was killed (kill -9, a lost Spark driver) stays pending until someone rolls
it back, and a pid says whether a writer lives only on its own host. So, as Hudi's lazy failed-write cleaning does,
the writer of every instant rewrites a small file (`.dbidx/timeline/heartbeats/<instant>.json`) every few seconds
from a background thread until the instant settles; an instant whose heartbeat has not been renewed for
`EXPIRY_INTERVALS` intervals is abandoned, and the next upsert (or `dbidx rollback --all-pending`) rolls it back.

Rolling back an instant whose writer is in fact alive but stalled is safe for the table: the rollback record takes
the next completion, and that writer's publish then refuses (InstantStateError). The heartbeat only keeps such
needless failures rare. The file says its own interval, so readers need no configuration; its time is the writer's
clock (clocks of the writers and cleaners must agree within an interval or so, as for Hudi's).
"""

from __future__ import annotations

import json
import math
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from dbidx.errors import DbidxError
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO

DEFAULT_INTERVAL_S = 10.0
EXPIRY_INTERVALS = 6  # a heartbeat older than this many of its intervals is expired (60 s by default)
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 3600.0  # what a heartbeat file may claim (anything else is not trusted)


@dataclass(frozen=True)
class HeartbeatState:
    """A heartbeat as read back: when it was last renewed (writer's clock), its interval, and whether it expired."""

    renewed_at_ms: int
    interval_s: float
    age_seconds: float

    @property
    def expired(self) -> bool:
        """Not renewed for EXPIRY_INTERVALS intervals: its writer is gone (or stalled past any reasonable pause)."""
        return self.age_seconds > EXPIRY_INTERVALS * self.interval_s

    @property
    def expires_in_seconds(self) -> float:
        """Seconds until it counts as expired if not renewed (0 once it has)."""
        return max(0.0, round(EXPIRY_INTERVALS * self.interval_s - self.age_seconds, 1))


def read_heartbeat(io: FileIO, instant: str, now_ms: float | None = None) -> HeartbeatState | None:
    """An instant's heartbeat, or None if it has none or it is not what dbidx writes (then only the claim's start
    time can tell: see `abandoned_since`)."""
    try:
        data = json.loads(io.read_bytes(layout.heartbeat_file(instant)))
    except (ValueError, OSError, DbidxError):
        return None
    if not isinstance(data, dict):
        return None
    renewed, interval = data.get("renewed_at_ms"), data.get("interval_s")
    if not isinstance(renewed, int) or isinstance(renewed, bool) or renewed <= 0:
        return None
    if (
        not isinstance(interval, (int, float))
        or isinstance(interval, bool)
        or not math.isfinite(interval)
        or not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S
    ):
        return None
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    return HeartbeatState(renewed, float(interval), round(max(0.0, (now_ms - renewed) / 1000), 1))


class Heartbeat:
    """The writer's side: writes the heartbeat at once, then renews it from a daemon thread until stopped."""

    def __init__(
        self, io: FileIO, instant: str, interval_s: float = DEFAULT_INTERVAL_S, claim: Mapping[str, Any] | None = None
    ) -> None:
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"heartbeat interval {interval_s} s is outside [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}]")
        self.io, self.instant, self.interval_s = io, instant, float(interval_s)
        self._claim = dict(claim or {})
        self._stop = threading.Event()
        self._failures = 0
        # 1. The first beat is written before the writer does anything else: an instant is never seen without one
        #    for longer than its claim's own create.
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"dbidx-heartbeat-{instant}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        body = {"instant": self.instant, "renewed_at_ms": int(time.time() * 1000), "interval_s": self.interval_s}
        self.io.write_atomic(layout.heartbeat_file(self.instant), json.dumps(self._claim | body).encode())

    def _run(self) -> None:
        # 2. Renew until stopped, or until the instant settled elsewhere (another process rolled it back): its claim
        #    is gone then, and a renewed heartbeat would only be a leftover.
        while not self._stop.wait(self.interval_s):
            try:
                if not self.io.exists(layout.requested_file(self.instant)) and not self.io.exists(
                    layout.inflight_file(self.instant)
                ):
                    return
                self._beat()
                self._failures = 0
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried; many in a row are reported once
                self._failures += 1
                if self._failures == EXPIRY_INTERVALS // 2:
                    warnings.warn(
                        f"instant {self.instant}: its heartbeat could not be renewed {self._failures} "
                        f"times in a row ({exc}); other processes will take the instant for abandoned "
                        "and roll it back if this goes on",
                        RuntimeWarning,
                        stacklevel=1,
                    )

    def stop(self, delete: bool = True) -> None:
        """Stop renewing (and wait for a beat in progress), then delete the file unless `delete` is False (an
        instant its process forgot without settling: the stale heartbeat then lets others clean it up)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if delete:
            self.io.delete(layout.heartbeat_file(self.instant))
