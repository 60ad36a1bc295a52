"""Bucket assignment (F26, F27): which file group a new key goes to. Pure Python: no cache, no Spark."""
