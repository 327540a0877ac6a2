"""The window pool's value for a session: the model's windows blob wrapped in an envelope naming exactly
which history it continues (model fingerprint, token count, sha256 of the tokens) and which stored global
KV bytes it continues (a digest over the chunk payloads of that history, as its state held them).

Knows nothing of the pool's budget or TTL. A pool entry is used only when all of these match what the
turn resumes from; anything else (another model, a shorter or forked history, stored chunks whose bytes
are not the ones the windows were computed over, corrupt bytes) is a miss. The chunk digest matters
because chunks are shared by content: a chunk of the same tokens that another session stored first keeps
that session's bytes, which a path other than this state's may have computed.
Layout: magic b"KVRP" | version u16 | fingerprint 32 B | n_tokens u64 | sha256(history u32le) 32 B |
chunks digest 32 B | blob.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from storage import history_digest as _storage_history_digest

__all__ = [
    "PoolEntry",
    "pack_pool_entry",
    "unpack_pool_entry",
    "history_digest",
    "chunks_digest",
    "chunks_digest_of",
]

_MAGIC = b"KVRP"
_VERSION = 2
_HEAD = struct.Struct("<4sH32sQ32s32s")
_RANGE = struct.Struct("<QQ")


def history_digest(tokens: Sequence[int]) -> bytes:
    """sha256 of the ids as u32 little-endian: the digest the pool's prefix index looks entries up by."""
    return _storage_history_digest(tokens)


def chunks_digest(ranges: Sequence[tuple[int, int]], payloads: Sequence[bytes]) -> bytes:
    """Digest of a history's global-KV chunks in order: their ranges and the sha256 of each payload."""
    if len(ranges) != len(payloads):
        raise ValueError(f"{len(ranges)} ranges but {len(payloads)} payloads")
    return chunks_digest_of(ranges, [hashlib.sha256(p).digest() for p in payloads])


def chunks_digest_of(ranges: Sequence[tuple[int, int]], payload_hashes: Sequence[bytes]) -> bytes:
    """`chunks_digest` from the payloads' sha256 digests (each chunk is hashed once per turn)."""
    if len(ranges) != len(payload_hashes):
        raise ValueError(f"{len(ranges)} ranges but {len(payload_hashes)} payload hashes")
    h = hashlib.sha256()
    for (start, end), digest in zip(ranges, payload_hashes, strict=True):
        h.update(_RANGE.pack(start, end))
        h.update(digest)
    return h.digest()


@dataclass(frozen=True, kw_only=True)
class PoolEntry:
    fingerprint: bytes
    n_tokens: int
    digest: bytes
    chunks: bytes
    windows: bytes

    def continues(
        self, fingerprint: bytes, history: Sequence[int], *, digest: bytes | None = None
    ) -> str | None:
        """None when this entry continues `history` under `fingerprint`; else why not.

        Args:
            digest: `history_digest(history)`, when the caller holds it.
        """
        if self.fingerprint != fingerprint:
            return "pool windows were written by another model fingerprint"
        if self.n_tokens != len(history):
            return f"pool windows end at {self.n_tokens}, history at {len(history)}"
        if self.digest != (digest if digest is not None else history_digest(history)):
            return "pool windows belong to another history of the same length"
        return None


def pack_pool_entry(
    *, fingerprint: bytes, history: Sequence[int], windows: bytes, chunks: bytes, digest: bytes | None = None
) -> bytes:
    """Wrap `windows` in the envelope.

    Args:
        chunks: `chunks_digest` of the stored chunks covering `history`, as the exporting state holds them.
        digest: `history_digest(history)`, when the caller holds it.
    """
    if len(fingerprint) != 32:
        raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    if len(chunks) != 32:
        raise ValueError(f"chunks digest must be 32 bytes, got {len(chunks)}")
    if digest is None:
        digest = history_digest(history)
    head = _HEAD.pack(_MAGIC, _VERSION, fingerprint, len(history), digest, chunks)
    return head + windows


def unpack_pool_entry(blob: bytes) -> PoolEntry | None:
    """The entry, or None for bytes that are not a pool entry of this version."""
    if len(blob) < _HEAD.size:
        return None
    magic, version, fingerprint, n_tokens, digest, chunks = _HEAD.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION:
        return None
    return PoolEntry(
        fingerprint=fingerprint, n_tokens=n_tokens, digest=digest, chunks=chunks, windows=blob[_HEAD.size :]
    )
