"""The persisted record-level index: its Parquet files (one sorted run per partition, shard and commit), the
publish-time conflict check, point lookups over the files, and index compaction."""
