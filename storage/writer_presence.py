"""Writer presence files: how writers of a table on a store with neither an exclusive create nor a conditional put
(and no commit lock) notice each other (docs/FORMAT.md section 11).

Each writer leaves a uniquely named file under `.dbidx/timeline/writers/` for its instant and then lists the others:
of two writers that overlap, at least one sees the other whatever the timing, and it refuses loudly instead of
racing to publish the same completion.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any, Callable

from dbidx.errors import UnsafeConcurrencyError
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO


def announce(io: FileIO, instant: str) -> str:
    """Leave a uniquely named presence file for an active writer; returns its name."""
    own = f"{instant}-{uuid.uuid4().hex}"
    io.write_atomic(
        f"{layout.WRITERS_DIR}/{own}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
    )
    return own


def refuse_second(io: FileIO, instant: str, ignore: set[str], record_of: Callable[[str], Any]) -> None:
    """Announce this writer, then refuse (UnsafeConcurrencyError, withdrawing the claim) if another unsettled
    writer is present; `ignore`: instants a rollback ends, `record_of`: the settled record of an instant or None."""
    own = announce(io, instant)
    others = [
        n
        for n in io.list_names(layout.WRITERS_DIR)
        if n != own and not n.startswith(".") and n.split("-")[0] not in ignore and record_of(n.split("-")[0]) is None
    ]
    if others:
        io.delete(f"{layout.WRITERS_DIR}/{own}")
        io.delete(layout.requested_file(instant))
        raise UnsafeConcurrencyError(
            f"the table at {io.root} is on a filesystem ({io.fs.type_name}) with neither an exclusive create nor a "
            f"conditional put, and another writer is active (instant {others[0].split('-')[0]}): two writers there "
            "could both publish the same completion and one commit would be lost. Give every writer the same "
            "commit_lock (e.g. dbidx.storage.commit_lock.FileCommitLock on a shared path), or, if that writer died "
            f"(its marker {layout.WRITERS_DIR}/{others[0]} is stale), roll its instant back: `dbidx rollback {io.root} "
            f"{others[0].split('-')[0]}`, or `dbidx rollback {io.root} --all-pending` when no writer runs."
        )


def forget(io: FileIO, instant: str) -> None:
    """Remove an instant's presence files (it settled)."""
    for name in io.list_names(layout.WRITERS_DIR):
        if name.startswith(instant + "-"):
            io.delete(f"{layout.WRITERS_DIR}/{name}")
