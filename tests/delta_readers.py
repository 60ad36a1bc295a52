"""The Delta readers a user's other engines use, for the open-table tests: deltalake's QueryBuilder (DataFusion),
polars and DuckDB with its delta extension (the bundled file of the `duckdb-ext-delta` package: nothing is
downloaded). Each returns the table's rows as a set of tuples of the given columns."""

from __future__ import annotations

from typing import Any, Sequence

import duckdb
import polars as pl
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

from dbidx.data import reads
from dbidx.demo import duckdb_delta_extension
from dbidx.table.facade import Table


def extension_file() -> str:
    """The delta extension shipped by the duckdb-ext-delta package for the installed duckdb."""
    found = duckdb_delta_extension()
    assert found, f"no delta extension for duckdb {duckdb.__version__} (pip install duckdb-ext-delta)"
    return found


def _rows(table: pa.Table, columns: Sequence[str]) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in columns)))


def via_deltalake(path: str, columns: Sequence[str], version: int | None = None) -> list[tuple]:
    dt = DeltaTable(path, version=version)
    out = QueryBuilder().register("t", dt).execute(f"select {', '.join(columns)} from t").read_all()
    return _rows(pa.table(out), columns)


def via_polars(path: str, columns: Sequence[str], version: int | None = None) -> list[tuple]:
    frame = pl.read_delta(path, version=version).select(list(columns))
    return _rows(frame.to_arrow(), columns)


def via_duckdb(path: str, columns: Sequence[str]) -> list[tuple]:
    con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
    con.execute(f"LOAD '{extension_file()}'")
    return _rows(con.execute(f"select {', '.join(columns)} from delta_scan('{path}')").fetch_arrow_table(), columns)


def via_dbidx(table: Table, columns: Sequence[str]) -> list[tuple]:
    return _rows(reads.read_arrow(table, columns=list(columns)), columns)


def via_delta_spark(spark: Any, path: str, columns: Sequence[str], version: int | None = None) -> list[tuple]:
    """Delta Lake on Spark (the tests' session loads it: tests/conftest.py), the protocol's reference reader."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return [tuple(r) for r in reader.load(path).select(*columns).collect()]


def assert_readers_agree(
    table: Table,
    columns: Sequence[str],
    expected: set[tuple] | None = None,
    spark: Any = None,
    polars_refuses: str | None = None,
    without: Sequence[str] = (),
) -> list[tuple]:
    """Every reader returns the same rows, without a repeated key (the first column), and `expected` if given;
    Delta Spark too when the test has the session (`spark`). `polars_refuses`: a reader feature polars refuses by
    name instead of reading (polars 2.2 checks the protocol's reader features: v2Checkpoint is not among its own).
    `without`: readers left out, each for a reason its caller names (DuckDB's delta extension on column mapping)."""
    path = table.io.path("")
    ours = via_dbidx(table, columns)
    readers = [("deltalake", via_deltalake(path, columns))]
    if "duckdb" not in without:
        readers.append(("duckdb", via_duckdb(path, columns)))
    if polars_refuses is None:
        readers.append(("polars", via_polars(path, columns)))
    else:
        from deltalake.exceptions import DeltaProtocolError

        try:
            via_polars(path, columns)
        except DeltaProtocolError as exc:
            assert polars_refuses in str(exc), exc
        else:
            raise AssertionError(f"polars read a table with reader feature {polars_refuses}")
    if spark is not None:
        readers.append(("Delta Spark", via_delta_spark(spark, path, columns)))
    for name, rows in readers:
        assert sorted(rows, key=repr) == sorted(ours, key=repr), f"{name} reads other rows than dbidx"
    if expected is not None:
        assert set(ours) == expected
    return ours
