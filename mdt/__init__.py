"""The record-level index (RLI files, conflicts, lookup, index compaction, build-index), the commit writer and
`Table`, the entry point that joins the table's index and data."""
