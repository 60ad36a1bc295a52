"""The one exception hierarchy of dbidx: every error a user can act on is a DbidxError.

Each message says what went wrong and where (a path, a key, an instant), and where it can, the likely cause.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CacheBusyError",
    "CacheCorruptError",
    "CacheError",
    "CacheMismatchError",
    "CacheServiceError",
    "CommitError",
    "ConfigError",
    "ConflictError",
    "CorruptFileError",
    "DbidxError",
    "DeltaFeatureError",
    "DuplicateKeyError",
    "ForeignCommitAfterPublishError",
    "ForeignCommitError",
    "ForeignDuplicateError",
    "FormatUpgradeError",
    "HistoryCompactedError",
    "HookError",
    "InstantStateError",
    "InvalidInputError",
    "InvalidKeyError",
    "InvalidPartitionError",
    "PartitionNotReadyError",
    "SchemaError",
    "StoreUnavailableError",
    "TableExistsError",
    "TableNotFoundError",
    "UnsafeConcurrencyError",
]


class DbidxError(Exception):
    """Base class of every error dbidx raises on purpose."""

    exit_code: int = 1  # the CLI's exit status; a subclass sets its own with `class X(Base, exit_code=N)`

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if exit_code is not None:
            cls.exit_code = exit_code


class ConfigError(DbidxError, exit_code=2):
    """A configuration value is missing, malformed or out of range."""


class InvalidInputError(DbidxError, exit_code=2):
    """A key, partition path or argument handed to dbidx is not acceptable."""


class InvalidKeyError(InvalidInputError):
    """A record key is null, empty or not a string."""


class InvalidPartitionError(InvalidInputError):
    """A partition path is absolute, escapes the table, or holds forbidden characters."""


class SchemaError(InvalidInputError):
    """Data does not match the table's recorded schema (a column's type differs, a column is missing)."""


class TableNotFoundError(DbidxError, exit_code=3):
    """No dbidx table exists at the given base URI."""


class TableExistsError(DbidxError, exit_code=3):
    """A table already exists where a new one was to be created."""


class CorruptFileError(DbidxError, exit_code=4):
    """A metadata or index file is truncated, unreadable or disagrees with its commit record."""


class ConflictError(DbidxError, exit_code=5):
    """A commit lost an optimistic-concurrency race: another instant completed with overlapping keys."""


class StoreUnavailableError(DbidxError, exit_code=5):
    """A request to the table's storage failed (network, throttling, server error): whether it took effect is
    unknown to the caller, which re-reads the state before deciding anything."""


class CommitError(DbidxError, exit_code=5):
    """An instant cannot be published as it stands (a task result is missing or repeated, a listed file is missing
    or has another size): it was rolled back, nothing is visible, and the batch can be run again."""


class UnsafeConcurrencyError(DbidxError, exit_code=5):
    """A second writer is active on a filesystem where dbidx cannot publish atomically beside it (no exclusive
    create, no conditional put, no commit lock): refused instead of risking a lost commit."""


class HookError(DbidxError):
    """A user hook (`upsert`'s on_task_written) raised, in a Spark task, an exception whose own type the driver
    cannot rebuild: the message names that type and carries the hook's message."""


class InstantStateError(DbidxError, exit_code=5):
    """An instant was used in a state that does not allow it (e.g. committing a rolled-back instant)."""


class HistoryCompactedError(DbidxError, exit_code=4):
    """An incremental read needs index files that compaction and cleaning have removed; reload instead."""


class DuplicateKeyError(DbidxError, exit_code=4):
    """The same record key was found at two locations where the index requires one."""


class CacheError(DbidxError, exit_code=6):
    """The executor-local RocksDB cache cannot be opened, written or trusted."""


class CacheCorruptError(CacheError):
    """A cache's stored bytes fail RocksDB's checksums or cannot be decoded: nothing read from it is trusted. A task
    session discards such a cache (it is a disposable replica), so the next attempt rebuilds it from the index."""


class CacheBusyError(CacheError):
    """Another process holds this cache directory for longer than the lock timeout."""


class CacheServiceError(CacheError):
    """A shard's cache service (cache.service) failed or went away in the middle of a request: the task attempt
    fails (Spark runs it again, and the retry starts a new service or opens the cache itself); nothing the attempt
    wrote is published."""


class CacheMismatchError(CacheError):
    """A cache directory belongs to another table, shard count or shard than the one asked for."""


class PartitionNotReadyError(CacheError):
    """A lookup asked for a partition that is not completely loaded in the cache (load it first)."""


class ForeignCommitError(DbidxError, exit_code=5):
    """The table's Delta log has a commit dbidx did not write (another engine wrote to the Delta table): dbidx
    refuses to write on top of it; re-index the table to adopt its state."""

    # The completion dbidx had published when another engine took its Delta version (None: nothing published).
    published: Any = None


class ForeignCommitAfterPublishError(ForeignCommitError):
    """Another engine took the Delta version of a completion dbidx had published (`published`): never rolled back."""

    def __init__(self, message: str, published: Any = None) -> None:
        super().__init__(message)
        self.published = published

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.published)


class ForeignDuplicateError(DuplicateKeyError):
    """Another engine's Delta version made a key live twice (a blind append of keys the table has): dbidx cannot
    give that key one location. Nothing of it was absorbed; the remedy the message names removes the repeats."""


class DeltaFeatureError(InvalidInputError):
    """A Delta table to adopt uses a protocol feature or layout dbidx cannot keep when it writes (column mapping,
    constraints, generated columns, files outside the table, ...): nothing was written."""


class ReadOnlyTableError(DbidxError, exit_code=3):
    """A read found Delta versions of other engines the index has not absorbed, and absorbing them needs write
    access to the table's `.dbidx/` folder, which this reader lacks: nothing was read or written. `dbidx sync URI`,
    run by a writer of the table, absorbs them; after it, readers without write access read again."""


class FormatUpgradeError(DbidxError, exit_code=3):
    """The table is in an older format that this dbidx does not read until it is upgraded (`dbidx upgrade URI`), or
    an upgrade cannot run (pending instants, a writer committed meanwhile): nothing was changed."""
