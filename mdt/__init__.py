"""The persisted index (MDT): table layout, commit timeline, partitioned record-level index files, compaction."""
