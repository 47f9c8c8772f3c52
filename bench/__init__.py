"""Benchmarks: hermes_store against the raw-sqlite3 floor (``python -m bench.run``)."""
