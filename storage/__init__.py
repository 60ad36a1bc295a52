"""The table's storage, log and state: FileIO, the timeline and its records, markers, properties, checkpoints and
the folded views of index and data files."""
