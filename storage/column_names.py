"""The names a table's data files give its columns when the Delta table maps them (column mapping in `name` mode):
each column's physical name in the files, and the field id a writer stores beside it.

Why on the table's FileIO: every data file of the table is read and written through it (data/files.py for dbidx's
own files, data/source_files.py for other engines'), and under column mapping every one of them names its columns
by physical name (Delta Spark's `col-<uuid>`), whatever the table's schema calls them: one mapping, applied where a
file is opened, keeps every reader and writer above in the table's own (logical) names. The mapping comes from the
Delta schema in force (data/column_mapping.py reads it; the table sets it on its FileIO whenever its view changes);
physical names never change for a column, so a mapping also reads the files of older versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import pyarrow as pa

FIELD_ID = b"PARQUET:field_id"  # the Arrow field metadata key pyarrow writes as a Parquet field id


@dataclass(frozen=True)
class ColumnNames:
    """Logical column name -> (physical name, field id), for the table's top-level columns."""

    columns: dict[str, tuple[str, int]] = field(default_factory=dict)

    def physical(self, name: str) -> str:
        """The name a data file gives column `name` (a column the mapping does not know keeps its name)."""
        mapped = self.columns.get(name)
        return mapped[0] if mapped is not None else name

    def physical_names(self, names: Iterable[str]) -> list[str]:
        return [self.physical(n) for n in names]

    def to_logical(self, table: pa.Table) -> pa.Table:
        """A table read from a data file, its columns renamed to the table's names."""
        logical = {physical: name for name, (physical, _id) in self.columns.items()}
        return table.rename_columns([logical.get(n, n) for n in table.column_names])

    def to_physical(self, table: pa.Table) -> pa.Table:
        """A table to write as a data file: its mapped columns under their physical names, with their field ids."""
        fields = []
        for f in table.schema:
            mapped = self.columns.get(f.name)
            if mapped is None:
                fields.append(f)
            else:
                meta = dict(f.metadata or {})
                meta[FIELD_ID] = str(mapped[1]).encode()
                fields.append(f.with_name(mapped[0]).with_metadata(meta))
        return pa.Table.from_arrays(table.columns, schema=pa.schema(fields, metadata=table.schema.metadata))
