"""The open table's data: Parquet data files, deletion vectors, the Delta log, the recorded schema, reads and
data compaction."""
