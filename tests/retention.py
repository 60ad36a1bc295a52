"""For tests of what a clean deletes, not of how long it waits: the table's `delta.deletedFileRetentionDuration` set
to a millisecond, so the clean may take a replaced data or deletion-vector file as soon as its `retain_completions`
allow, as it did before the retention governed them (index/clean.py; how long it waits:
tests/table/test_clean_retention.py). A properties change is a completion (and a Delta version) of its own."""

from __future__ import annotations

from typing import Any

SHORT_RETENTION = {"delta.deletedFileRetentionDuration": "interval 1 milliseconds"}


def clean_without_waiting(table: Any) -> None:
    """Set the table's retention of removed files to a millisecond (a `Table`, or anything with its
    `set_delta_properties`)."""
    table.set_delta_properties(SHORT_RETENTION)
