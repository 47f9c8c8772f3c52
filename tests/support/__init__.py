"""Helpers the tests share: worker processes, legacy file builders, a latency proxy, the
original store's copy (``seed_store``), corpora."""
