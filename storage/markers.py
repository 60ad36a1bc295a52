"""Markers: every file an instant's tasks write is announced under `.dbidx/markers/<instant>/` before it is written.

Why: a task attempt that dies, or a speculative duplicate that loses, leaves files the committing process never
hears of. A marker is an empty file named by the quoted table-relative path of the file it announces, or (a task
announcing a whole phase's files at once, `announce_all`) a list marker `l-<XXH64 of its content>` holding them as a
JSON list: one write instead of one per file, one PUT on an object store for a phase's 30-odd data files. The commit
lists the files of the winning attempts only, and everything else a marker names is deleted after the commit (or
all of it after a rollback). Readers only read files a completed commit lists, so an unlisted file is never visible,
even before it is cleaned.
"""

from __future__ import annotations

import json
import re
from typing import Iterable
from urllib.parse import quote, unquote

import xxhash

from dbidx.errors import CorruptFileError, InvalidInputError
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO

MARKERS_DIR = f"{layout.META_DIR}/markers"
_MAX_NAME = 200  # common filesystems allow 255 bytes per name
LIST_PREFIX = "l-"
# Whole names of a list marker and of a long path's hashed marker (an XXH64 is 16 hex digits). A file's own marker,
# its quoted path, never matches either (every dbidx file ends in .parquet or .bin), even when the path starts with
# "l-" or "h-" (a partition value or column named so).
_LIST_NAME = re.compile(r"l-[0-9a-f]{16}")
_HASHED_NAME = re.compile(r"h-[0-9a-f]{16}")


def marker_dir(instant: str) -> str:
    """Where the markers of one instant live."""
    return f"{MARKERS_DIR}/{layout.validate_instant(instant)}"


def marker_name(rel: str) -> str:
    """The marker's file name: the percent-encoded path, or for a path too long for one name (deep partitions) an
    XXH64 of it prefixed `h-`, the path then being the marker's content."""
    name = quote(rel, safe="")
    return name if len(name) <= _MAX_NAME else "h-" + xxhash.xxh64_hexdigest(rel.encode("utf-8"))


def marker_of(instant: str, rel: str) -> str:
    """The marker path announcing one file."""
    return f"{marker_dir(instant)}/{marker_name(rel)}"


def announce(io: FileIO, instant: str, rel: str) -> None:
    """Create the marker of a file about to be written (before the first byte of it). The file's path is guarded
    first: a path that resolves out of the table (a symlinked partition) fails here, before any marker or byte,
    so the rollback that follows has nothing outside the table to delete."""
    io.guard(rel, "write")
    name = marker_name(rel)
    io.write_atomic(f"{marker_dir(instant)}/{name}", rel.encode("utf-8") if _HASHED_NAME.fullmatch(name) else b"")


def announce_all(io: FileIO, instant: str, rels: Iterable[str]) -> None:
    """Announce several files about to be written with one list marker (one file alone: its own marker). Every
    path is guarded first, as in `announce`, so a path out of the table fails before any marker or byte."""
    rels = sorted(set(rels))
    if len(rels) <= 1:
        for rel in rels:
            announce(io, instant, rel)
        return
    for rel in rels:
        io.guard(rel, "write")
    body = json.dumps(rels).encode("utf-8")
    io.write_atomic(f"{marker_dir(instant)}/{LIST_PREFIX}{xxhash.xxh64_hexdigest(body)}", body)


def _listed_in(io: FileIO, instant: str, name: str) -> list[str]:
    """The paths a list marker names, checked: its name is the XXH64 of its content, a JSON list of strings."""
    body = io.read_bytes(f"{marker_dir(instant)}/{name}")
    if name != LIST_PREFIX + xxhash.xxh64_hexdigest(body):
        raise InvalidInputError("its content does not match the checksum in its name")
    try:
        rels = json.loads(body.decode("utf-8"))
    except RecursionError as exc:  # a crafted, deeply nested body
        raise InvalidInputError("it is nested too deeply to be a list of paths") from exc
    if not isinstance(rels, list) or not all(isinstance(rel, str) for rel in rels):
        raise InvalidInputError("it does not hold a list of paths")
    return rels


def _named_by(io: FileIO, instant: str, name: str) -> list[str]:
    """The files one marker announces (unvalidated)."""
    if _LIST_NAME.fullmatch(name):
        return _listed_in(io, instant, name)
    if _HASHED_NAME.fullmatch(name):
        return [io.read_bytes(f"{marker_dir(instant)}/{name}").decode("utf-8")]
    return [unquote(name)]


def announced_files(io: FileIO, instant: str) -> list[str]:
    """Every file some attempt of an instant announced (it may or may not exist); crafted names that would leave
    the table are refused, never followed."""
    out = []
    for name in io.list_names(marker_dir(instant)):
        if name.startswith(".tmp-"):
            continue
        try:
            try:
                named = _named_by(io, instant, name)
            except CorruptFileError:
                if not io.exists(f"{marker_dir(instant)}/{name}"):
                    continue  # withdrawn meanwhile by its own attempt, which deleted its files first
                raise
            out += [layout.validate_instant_file(rel, instant) for rel in named]
        except (InvalidInputError, UnicodeDecodeError, ValueError) as exc:
            raise CorruptFileError(
                f"marker {io.path(marker_dir(instant))}/{name} of instant {instant} is not valid: {exc}. A marker only "
                "announces a file dbidx writes, and this one names none: delete it, then run `dbidx rollback "
                f"{io.root} --all-pending` if the instant is still pending (its writer died), else `dbidx repair "
                f"{io.root}` to sweep what the settled instant left"
            ) from exc
    return sorted(set(out))


def discard_unlisted(io: FileIO, instant: str, keep: Iterable[str]) -> list[str]:
    """Delete the announced files of an instant that are not in `keep`, then its markers; returns the deleted."""
    keep_set = set(keep)
    deleted = [rel for rel in announced_files(io, instant) if rel not in keep_set and io.delete(rel)]
    io.delete_dir(marker_dir(instant))
    return deleted


def discard_losing_tries(io: FileIO, instant: str, planned: Iterable[str], listed: set[str]) -> list[str]:
    """After a publish whose pieces may have run more than once (a retried or speculative Spark task): delete the
    planned names the record does not list (a first try's files) and every announced file it does not list (later
    tries'), then the markers; returns the deleted."""
    deleted = [rel for rel in sorted(set(planned) - listed) if io.delete(rel)]
    return deleted + discard_unlisted(io, instant, keep=listed)


def withdraw(io: FileIO, instant: str, written: Iterable[str], listed: set[str]) -> None:
    """Delete this attempt's files that a settled instant did not list, with their markers: a file's own marker, and
    each list marker whose files were all deleted here (another attempt's list markers are left alone)."""
    gone = set()
    for rel in written:
        if rel not in listed:
            io.delete(rel)
            io.delete(marker_of(instant, rel))
            gone.add(rel)
    if not gone:
        return
    for name in io.list_names(marker_dir(instant)):
        if _LIST_NAME.fullmatch(name):
            try:
                named = _listed_in(io, instant, name)
            except (InvalidInputError, ValueError, CorruptFileError):
                continue  # not this attempt's to judge: the instant's sweep reports a damaged marker
            if named and set(named) <= gone:
                io.delete(f"{marker_dir(instant)}/{name}")
