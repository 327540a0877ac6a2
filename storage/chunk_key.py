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


def _first_difference(a: bytes, b: bytes, n: int) -> int:
    """The first byte offset below n where a and b differ (n when none does; both at least n long)."""
    x, y = np.frombuffer(a, dtype=np.uint8, count=n), np.frombuffer(b, dtype=np.uint8, count=n)
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if differ.size else n


class ChainAddresses:
    """`chunk_address` with the addresses already computed kept by (parent, chunk length): a store walks a
    session's whole chain two or three times a turn (its lookups, a put's parents), about 790 sha256 a
    turn at a 64K-token history (1.1 us each), and the chain grows at its end only.

    A kept address serves only the very tokens it was computed from (compared byte for byte), so it is
    the address `chunk_address` gives; a parent keeps the last chunk of each length asked after it (a
    branch replaces it: the other branch computes again). At most `capacity_bytes` of kept token bytes
    (the oldest entries go first). Not thread-safe: the store calls it under its lock.

    Whole walks are kept too (`remember_walk`, `leading`): the full-chunk addresses of a history walked
    from a root, with the history's bytes, one walk per first chunk. A later walk whose tokens start with
    the same bytes (one comparison over the kept part) takes those addresses as they are, instead of a
    slice, a memo key and a chunk comparison per chunk (a lookup at a 64K-token history walked 250 chunks
    that way, about 0.5 ms, twice a turn); one that differs further on takes the whole chunks before the
    first differing byte. Sessions that share their first chunk share one kept walk, so each gets only
    the common part of the last one kept. At most `walk_capacity_bytes` of history bytes are held.
    """

    def __init__(self, capacity_bytes: int = 16 << 20, walk_capacity_bytes: int = 32 << 20) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if walk_capacity_bytes < 0:
            raise ValueError(f"walk_capacity_bytes must be >= 0, got {walk_capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.walk_capacity_bytes = walk_capacity_bytes
        self._kept: dict[tuple[bytes, int], tuple[bytes, bytes]] = {}
        self._bytes = 0
        # (root, chunk tokens, the first chunk's bytes) -> (the history's bytes, its full chunks' addresses),
        # oldest first
        self._walks: dict[tuple[bytes, int, bytes], tuple[bytes, list[bytes]]] = {}
        self._walk_bytes = 0
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

    def leading(self, root: bytes, toks: bytes, size: int, limit: int) -> list[bytes]:
        """The addresses of the first full chunks of `toks` (`size` tokens each, u32 LE bytes) on the chain
        from `root`, as many as a kept walk of the same leading bytes holds, at most `limit`: element i is
        the address of tokens [i * size, (i + 1) * size), the parent of chunk i + 1. Empty when no kept
        walk starts with these bytes; the caller computes the rest with `address`.
        """
        head = size * 4
        if limit <= 0 or len(toks) < head or self.walk_capacity_bytes == 0:
            return []
        key = (root, size, toks[:head])
        kept = self._walks.get(key)
        if kept is None:
            return []
        kept_toks, addresses = kept
        count = min(limit, len(addresses), len(toks) // head)
        # one comparison of the kept part: equal bytes have equal chunk addresses
        if not toks.startswith(memoryview(kept_toks)[: count * head]):
            # another history that starts the same (sessions sharing a prompt, an edit further on): the
            # whole chunks before the first differing byte still have the kept addresses
            count = _first_difference(toks, kept_toks, count * head) // head
            if count == 0:
                return []
        self._walks[key] = self._walks.pop(key)  # most recently used last
        return addresses[:count]

    def remember_walk(self, root: bytes, toks: bytes, size: int, addresses: list[bytes]) -> None:
        """Keep `addresses`, the chain of `toks`'s first full chunks from `root` (as `leading` returns
        them), replacing what was kept for the same first chunk; the caller must have computed them
        with `address` or `leading` for these very bytes."""
        head = size * 4
        # (only immutable bytes are kept: a buffer that changed later would serve stale addresses)
        if not addresses or type(toks) is not bytes or len(toks) < len(addresses) * head:
            return
        key = (root, size, toks[:head])
        old = self._walks.pop(key, None)
        if old is not None:
            self._walk_bytes -= len(old[0])
        if len(toks) > self.walk_capacity_bytes:
            return
        while self._walks and self._walk_bytes + len(toks) > self.walk_capacity_bytes:
            oldest = next(iter(self._walks))
            self._walk_bytes -= len(self._walks.pop(oldest)[0])
        self._walks[key] = (toks, list(addresses))
        self._walk_bytes += len(toks)

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    @property
    def walk_bytes(self) -> int:
        return self._walk_bytes


def tenant_tag(salt: bytes) -> bytes:
    """Index tag of a tenant; derived from its secret salt so that it changes when the salt does."""
    return hashlib.sha256(b"tenant" + salt).digest()[:TAG_BYTES]


def session_tag(salt: bytes, session_id: str) -> bytes:
    return hashlib.sha256(b"session" + salt + session_id.encode()).digest()[:TAG_BYTES]


def model_tag(model_fingerprint: str) -> bytes:
    return hashlib.sha256(b"model" + model_fingerprint.encode()).digest()[:TAG_BYTES]
