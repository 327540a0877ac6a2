"""Chunk addresses: a chain of sha256 over (model fingerprint, tenant salt, token ids), so one tenant's
sessions that share a prefix share chunks and no other tenant or model can compute the same address.

h_0 = sha256("kvresume/chunk/v1" | len(fp) | fp | salt); the chunk covering tokens [s, e) whose chain
reaches s with parent h has address sha256(h | (e - s) as u32 | token ids as u32 little-endian). A full
chunk's address is also the parent of the next chunk; a partial tail chunk is a leaf.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from array import array
from collections.abc import Sequence

import numpy as np

ADDRESS_BYTES = 32
TAG_BYTES = 16
MAX_ID_CHARS = 256
_DOMAIN = b"kvresume/chunk/v1"
_U32 = struct.Struct("<I")


def check_id(kind: str, value: str) -> None:
    """Tenant, session, fingerprint and actor ids are non-empty strings of bounded length.

    Raises:
        ValueError: naming the kind of id and the bad value.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise ValueError(f"{kind} must be a non-empty str of at most {MAX_ID_CHARS} chars, got {value!r}")


def token_bytes(token_ids: Sequence[int] | bytes) -> bytes:
    """Token ids (any sequence of ints, read once without a copy) as u32 little-endian bytes; `bytes`
    input is taken as already encoded that way.

    Raises:
        ValueError: an id outside [0, 2**32), or bytes whose length is not a multiple of 4.
    """
    if isinstance(token_ids, bytes | bytearray | memoryview):
        raw = bytes(token_ids)
        if len(raw) % 4:
            raise ValueError(f"token bytes must be u32 little-endian, got length {len(raw)}")
        return raw
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    assert arr.itemsize == 4
    if struct.pack("=I", 1) != _U32.pack(1):
        arr.byteswap()
    return arr.tobytes()


def largest_id(ids: bytes) -> int:
    """The largest of token ids given as u32 little-endian bytes (`token_bytes`), 0 for none: one numpy
    reduction, where `max()` over a 64K-token list took about 1 ms.

    Raises:
        ValueError: bytes whose length is not a multiple of 4.
    """
    if len(ids) % 4:
        raise ValueError(f"token bytes must be u32 little-endian, got length {len(ids)}")
    return int(np.frombuffer(ids, dtype="<u4").max()) if ids else 0


def largest_id_reference(ids: bytes) -> int:
    """The slow twin of `largest_id`: the ids unpacked one by one."""
    if len(ids) % 4:
        raise ValueError(f"token bytes must be u32 little-endian, got length {len(ids)}")
    return max((v for (v,) in _U32.iter_unpack(ids)), default=0)


@functools.lru_cache(maxsize=1024)
def chain_root(model_fingerprint: str, salt: bytes) -> bytes:
    """The first parent of a tenant's chains under one model: a pure function of its arguments, kept
    (every lookup and put asks for it: about 2% of the samples holding the interpreter lock in a py-spy
    --gil profile of 64 no-op sessions)."""
    fp = model_fingerprint.encode()
    return hashlib.sha256(_DOMAIN + _U32.pack(len(fp)) + fp + salt).digest()


def chunk_address(parent: bytes, tokens: bytes) -> bytes:
    """Address of the chunk holding `tokens` (u32 LE bytes) after `parent` in the chain."""
    return hashlib.sha256(parent + _U32.pack(len(tokens) // 4) + tokens).digest()


class ChainAddresses:
    """`chunk_address` with the addresses already computed kept by (parent, chunk length): a store walks a
    session's whole chain two or three times a turn (its lookups, a put's parents), about 790 sha256 a
    turn at a 64K-token history (1.1 us each), and the chain grows at its end only.

    A kept address serves only the very tokens it was computed from (compared byte for byte), so it is
    the address `chunk_address` gives; a parent keeps the last chunk of each length asked after it (a
    branch replaces it: the other branch computes again). At most `capacity_bytes` of kept token bytes
    (the oldest entries go first). Not thread-safe: the store calls it under its lock.
    """

    def __init__(self, capacity_bytes: int = 16 << 20) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._kept: dict[tuple[bytes, int], tuple[bytes, bytes]] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def address(self, parent: bytes, tokens: bytes) -> bytes:
        """`chunk_address(parent, tokens)`."""
        key = (parent, len(tokens))
        held = self._kept.get(key)
        if held is not None and held[0] == tokens:
            self.hits += 1
            return held[1]
        self.misses += 1
        addr = chunk_address(parent, tokens)
        if held is not None:
            self._bytes -= len(held[0])
            del self._kept[key]
        while self._kept and self._bytes + len(tokens) > self.capacity_bytes:
            oldest = next(iter(self._kept))
            self._bytes -= len(self._kept.pop(oldest)[0])
        if len(tokens) <= self.capacity_bytes:
            self._kept[key] = (tokens, addr)
            self._bytes += len(tokens)
        return addr

    @property
    def kept_bytes(self) -> int:
        return self._bytes


def tenant_tag(salt: bytes) -> bytes:
    """Index tag of a tenant; derived from its secret salt so that it changes when the salt does."""
    return hashlib.sha256(b"tenant" + salt).digest()[:TAG_BYTES]


def session_tag(salt: bytes, session_id: str) -> bytes:
    return hashlib.sha256(b"session" + salt + session_id.encode()).digest()[:TAG_BYTES]


def model_tag(model_fingerprint: str) -> bytes:
    return hashlib.sha256(b"model" + model_fingerprint.encode()).digest()[:TAG_BYTES]
