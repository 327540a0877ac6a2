"""The window pool's value for a session: the model's windows blob wrapped in an envelope naming exactly
which history it continues (model fingerprint, token count, sha256 of the tokens).

Knows nothing of the pool's budget or TTL. A pool entry is used only when all three match the history
the turn resumes; anything else (another model, a shorter or forked history, corrupt bytes) is a miss.
Layout: magic b"KVRP" | version u16 | fingerprint 32 B | n_tokens u64 | sha256(history u32le) 32 B | blob.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PoolEntry", "pack_pool_entry", "unpack_pool_entry", "history_digest"]

_MAGIC = b"KVRP"
_VERSION = 1
_HEAD = struct.Struct("<4sH32sQ32s")


def history_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).digest()


@dataclass(frozen=True, kw_only=True)
class PoolEntry:
    fingerprint: bytes
    n_tokens: int
    digest: bytes
    windows: bytes

    def continues(self, fingerprint: bytes, history: Sequence[int]) -> str | None:
        """None when this entry continues `history` under `fingerprint`; else why not."""
        if self.fingerprint != fingerprint:
            return "pool windows were written by another model fingerprint"
        if self.n_tokens != len(history):
            return f"pool windows end at {self.n_tokens}, history at {len(history)}"
        if self.digest != history_digest(history):
            return "pool windows belong to another history of the same length"
        return None


def pack_pool_entry(*, fingerprint: bytes, history: Sequence[int], windows: bytes) -> bytes:
    if len(fingerprint) != 32:
        raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    head = _HEAD.pack(_MAGIC, _VERSION, fingerprint, len(history), history_digest(history))
    return head + windows


def unpack_pool_entry(blob: bytes) -> PoolEntry | None:
    """The entry, or None for bytes that are not a pool entry of this version."""
    if len(blob) < _HEAD.size:
        return None
    magic, version, fingerprint, n_tokens, digest = _HEAD.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION:
        return None
    return PoolEntry(fingerprint=fingerprint, n_tokens=n_tokens, digest=digest, windows=blob[_HEAD.size :])
