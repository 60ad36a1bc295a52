"""The table: `Table`, the entry point that joins the index and the data; the commit writer that publishes both;
build-index, upgrade, verify, absorption of other engines' Delta versions, and the table services."""
