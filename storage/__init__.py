"""Bytes on disk and in RAM: RocksDB global-KV store, window pool, retention, residency, audit log.

Knows nothing of tensors (never imports torch); the cache format belongs to model/.
"""

from storage.errors import StorageError

__all__ = ["StorageError"]
