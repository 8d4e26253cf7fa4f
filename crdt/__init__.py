"""Replicated state for p2pshard: pycrdt documents with majority reads and writes (ddata mode).

The replicator lands with the replicated-state issue; this package sits between ``membership``
(which it may import) and ``p2pshard`` (which it must not).
"""
