"""Faults the tests inject into real storage calls (the files and the store stay real)."""

from __future__ import annotations

import pytest

from dbidx.storage import layout
from dbidx.storage.fileio import FileIO


def record_create_fails_once(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The next create of a completion record fails as a full disk would (ENOSPC), after the writer's Delta version
    is on storage; every other create goes through. Returns the list the failed path is appended to."""
    real = FileIO.create_exclusive
    failed: list[str] = []

    def full_disk_once(self: FileIO, rel: str, data: bytes) -> bool:
        if rel.startswith(layout.COMPLETED_DIR + "/") and not failed:
            failed.append(rel)
            raise OSError(28, "No space left on device")
        return real(self, rel, data)

    monkeypatch.setattr(FileIO, "create_exclusive", full_disk_once)
    return failed
