"""Markers: a file's own marker and a list marker announce files before they are written; the sweeps, rollbacks
and a withdrawing attempt read both, and a damaged or crafted list marker is refused, never followed."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import xxhash

from dbidx.config import CacheConfig
from dbidx.data.files import data_file_path
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout, leftovers, markers


@pytest.fixture()
def table(tmp_path: Path) -> Table:
    return Table.create(str(tmp_path / "t"), num_shards=2)


def files_of(instant: str, attempt: int, n: int) -> list[str]:
    return [data_file_path(f"dt=2025-03-0{i + 1}", f"fg-{i}", instant, attempt) for i in range(n)]


def test_one_list_marker_announces_a_phase_and_is_read_back(table: Table) -> None:
    instant = table.timeline.start("commit").instant
    mine, single = files_of(instant, 7, 3), files_of(instant, 8, 1)
    markers.announce_all(table.io, instant, mine + mine[:1])  # a repeat is announced once
    markers.announce_all(table.io, instant, single)  # one file: its own marker
    names = table.io.list_names(markers.marker_dir(instant))
    assert len(names) == 2 and sum(name.startswith(markers.LIST_PREFIX) for name in names) == 1
    assert markers.announced_files(table.io, instant) == sorted(mine + single)


def test_a_withdrawing_attempt_deletes_its_files_and_its_list_markers_only(table: Table) -> None:
    instant = table.timeline.start("commit").instant
    mine, other = files_of(instant, 1, 3), files_of(instant, 2, 2)
    for rels in (mine, other):
        markers.announce_all(table.io, instant, rels)
        for rel in rels:
            table.io.write_atomic(rel, b"x")
    markers.withdraw(table.io, instant, mine, listed=set())
    assert not any(table.io.exists(rel) for rel in mine) and all(table.io.exists(rel) for rel in other)
    assert markers.announced_files(table.io, instant) == sorted(other)  # the other attempt's marker stays


@pytest.mark.parametrize(
    "body", [b'["../../victim.txt", "dt=x/a.parquet"]', b'{"not": "a list"}', b"[1, 2]", b"not json"]
)
def test_a_crafted_list_marker_is_refused_by_the_sweep(table: Table, tmp_path: Path, body: bytes) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    upsert_arrow(
        pa.table({"id": ["a"], "dt": ["2025-03-01"]}),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    settled = table.timeline.completed()[-1].instant
    table.io.write_atomic(f"{markers.marker_dir(settled)}/{markers.LIST_PREFIX}{xxhash.xxh64_hexdigest(body)}", body)
    with pytest.raises(CorruptFileError, match="marker"):
        leftovers.sweep_settled(table.io, table.timeline)
    assert victim.read_text() == "precious" and table.io.exists(layout.PROPERTIES_FILE)


def test_a_list_marker_whose_content_does_not_match_its_name_is_refused(table: Table) -> None:
    instant = table.timeline.start("commit").instant
    body = json.dumps(files_of(instant, 1, 2)).encode()
    table.io.write_atomic(f"{markers.marker_dir(instant)}/{markers.LIST_PREFIX}{'0' * 16}", body)
    with pytest.raises(CorruptFileError, match="checksum"):
        markers.announced_files(table.io, instant)


def test_an_upsert_announces_its_data_and_index_files_with_list_markers(
    table: Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task writes one list marker per phase (data files, index files) instead of one marker per file, and after
    the commit no marker and no unlisted file is left."""
    writes: list[str] = []
    original = table.io.write_atomic

    def counting(rel: str, data: bytes) -> None:
        writes.append(rel)
        original(rel, data)

    monkeypatch.setattr(table.io, "write_atomic", counting)
    batch = pa.table({"id": [f"k{i}" for i in range(200)], "dt": [f"2025-03-0{1 + i % 5}" for i in range(200)]})
    upsert_arrow(batch, table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "c")))
    marker_writes = [rel for rel in writes if rel.startswith(markers.MARKERS_DIR)]
    assert marker_writes and all(rel.rsplit("/", 1)[1].startswith(markers.LIST_PREFIX) for rel in marker_writes)
    assert len(marker_writes) <= 2 * table.num_shards  # data files, then index files, per task
    assert table.io.list_dirs(markers.MARKERS_DIR) == []


@pytest.mark.parametrize(
    "column, value, hive", [("dt", "l-eu", False), ("l-region", "eu", True), ("dt", "h-eu", False)]
)
def test_a_files_own_marker_that_starts_like_a_list_or_hashed_marker_is_read_as_its_own(
    table: Table, tmp_path: Path, column: str, value: str, hive: bool
) -> None:
    """A task writing one data file announces it with its own marker, the quoted path; a path starting `l-` or `h-`
    (a partition value or column named so) must still be read as that file's marker, or the cleanup after the
    publish fails, and every later upsert's sweep with it."""
    config = CacheConfig(base_path=str(tmp_path / "c"))
    for i in range(2):
        upsert_arrow(
            pa.table({"id": [f"k{i}"], column: [value]}),
            table,
            key="id",
            partition=column,
            hive_style=hive,
            cache_config=config,
        )
    assert len(table.timeline.completed()) == 2 and table.io.list_dirs(markers.MARKERS_DIR) == []


def test_a_list_marker_withdrawn_while_the_publisher_reads_the_markers_is_skipped(
    table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher lists an instant's markers, then reads each; a losing attempt may withdraw (its files first,
    then its list marker) in between. The vanished marker is skipped, not reported as damage."""
    instant = table.timeline.start("commit").instant
    loser = files_of(instant, 9, 2)
    markers.announce_all(table.io, instant, loser)
    for rel in loser:
        table.io.write_atomic(rel, b"x")
    listed = table.io.list_names(markers.marker_dir(instant))
    markers.withdraw(table.io, instant, loser, listed=set())
    monkeypatch.setattr(table.io, "list_names", lambda rel_dir: listed)  # the listing taken before the withdraw
    assert markers.announced_files(table.io, instant) == []


def test_a_deeply_nested_list_marker_is_refused_as_damage(table: Table) -> None:
    instant = table.timeline.start("commit").instant
    body = b"[" * 100_000 + b"]" * 100_000
    table.io.write_atomic(f"{markers.marker_dir(instant)}/{markers.LIST_PREFIX}{xxhash.xxh64_hexdigest(body)}", body)
    with pytest.raises(CorruptFileError, match="nested"):
        markers.announced_files(table.io, instant)
