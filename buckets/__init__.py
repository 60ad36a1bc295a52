"""Bucket assignment (docs/DESIGN.md section 4): which file group a new key goes to. Pure Python: no cache, no Spark."""
