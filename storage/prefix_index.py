"""Prefix index of pooled histories: per tenant and namespace (a model fingerprint), the digest of each
pooled entry's token history -> the sessions whose entry holds it, so a prompt finds the longest pooled
history it starts with by content. Knows nothing of what the histories mean or of the pool's values.

In the spirit of a radix cache (SGLang's RadixAttention keeps a token trie of cached prefixes) but keyed
only at turn ends: an entry exists for exactly the histories a pool entry continues, so a lookup hashes
the prompt once (sha256 over its u32 little-endian ids, snapshotted at each indexed length) and never
walks tokens per node. The index is owned by `WindowPool`, which adds and removes keys with its entries,
so purge, TTL expiry and the byte budget apply to it as they do to the pool.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storage.chunk_key import token_bytes

__all__ = ["ContentKey", "PrefixIndex", "history_digest", "longest_prefix_by_scan", "prefix_digests"]

DIGEST_BYTES = 32


def history_digest(token_ids: Sequence[int] | bytes) -> bytes:
    """sha256 of the ids as u32 little-endian (the digest a pool entry's envelope names).

    Raises:
        ValueError: an id outside [0, 2**32).
    """
    raw = token_bytes(token_ids)
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True, kw_only=True)
class ContentKey:
    """What a pool entry continues, by content.

    Attributes:
        namespace: entries of another namespace never match (the model fingerprint, hex).
        n_tokens: length of the history the entry continues (> 0).
        digest: `history_digest` of those tokens.
    """

    namespace: str
    n_tokens: int
    digest: bytes

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("content key namespace must be non-empty")
        if self.n_tokens <= 0:
            raise ValueError(f"content key n_tokens={self.n_tokens} must be positive")
        if len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"content key digest must be {DIGEST_BYTES} bytes, got {len(self.digest)}")

    @classmethod
    def of(cls, namespace: str, token_ids: Sequence[int]) -> ContentKey:
        return cls(namespace=namespace, n_tokens=len(token_ids), digest=history_digest(token_ids))


class PrefixIndex:
    """(tenant, namespace) -> (n_tokens, digest) -> sessions. Not thread-safe: its owner's lock guards it.

    Invariant: `_lengths[(tenant, ns)]` is the sorted list of the distinct n_tokens that have at least one
    session in `_keys`; a (tenant, ns) with no key has neither entry.
    """

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str], dict[tuple[int, bytes], dict[str, None]]] = {}
        self._lengths: dict[tuple[str, str], list[int]] = {}
        self._count: dict[tuple[str, str, int], int] = {}

    def __len__(self) -> int:
        return sum(len(s) for by_key in self._keys.values() for s in by_key.values())

    def add(self, tenant: str, session: str, key: ContentKey) -> None:
        space = (tenant, key.namespace)
        sessions = self._keys.setdefault(space, {}).setdefault((key.n_tokens, key.digest), {})
        if session in sessions:
            return
        sessions[session] = None
        counted = (tenant, key.namespace, key.n_tokens)
        if self._count.get(counted, 0) == 0:
            bisect.insort(self._lengths.setdefault(space, []), key.n_tokens)
        self._count[counted] = self._count.get(counted, 0) + 1

    def remove(self, tenant: str, session: str, key: ContentKey) -> None:
        space = (tenant, key.namespace)
        by_key = self._keys.get(space)
        sessions = by_key.get((key.n_tokens, key.digest)) if by_key is not None else None
        if sessions is None or session not in sessions:
            return
        del sessions[session]
        if not sessions:
            del by_key[(key.n_tokens, key.digest)]  # type: ignore[union-attr]
        counted = (tenant, key.namespace, key.n_tokens)
        self._count[counted] -= 1
        if self._count[counted] == 0:
            del self._count[counted]
            lengths = self._lengths[space]
            del lengths[bisect.bisect_left(lengths, key.n_tokens)]
            if not lengths:
                del self._lengths[space], self._keys[space]

    def lengths(self, tenant: str, namespace: str, max_tokens: int) -> list[int]:
        """The indexed history lengths <= max_tokens of this tenant and namespace, ascending (a copy)."""
        lengths = self._lengths.get((tenant, namespace), [])
        return lengths[: bisect.bisect_right(lengths, max_tokens)]

    def sessions(self, tenant: str, namespace: str, n_tokens: int, digest: bytes) -> list[str]:
        """Sessions whose entry continues exactly that history, most recently added last."""
        by_key = self._keys.get((tenant, namespace), {})
        return list(by_key.get((n_tokens, digest), {}))


def prefix_digests(token_ids: Sequence[int] | bytes, lengths: Sequence[int]) -> dict[int, bytes]:
    """`history_digest(token_ids[:n])` for each n in ascending `lengths`, in one pass over the ids."""
    raw = token_bytes(token_ids)
    h = hashlib.sha256()
    out: dict[int, bytes] = {}
    done = 0
    for n in lengths:
        if n * 4 > len(raw):
            break
        h.update(raw[done * 4 : n * 4])
        done = n
        out[n] = h.copy().digest()
    return out


def longest_prefix_by_scan(
    histories: Iterable[tuple[str, Sequence[int]]], token_ids: Sequence[int], max_tokens: int
) -> tuple[int, set[str]]:
    """Slow reference twin of a prefix-index lookup: compare every history with the prompt id by id.

    Returns:
        (n, sessions): the longest length n <= max_tokens of a history that `token_ids` starts with
        (0 when none), and the sessions holding a history of that length that matches.
    """
    best, who = 0, set()
    for session, history in histories:
        n = len(history)
        if n == 0 or n > max_tokens or n > len(token_ids) or list(token_ids[:n]) != list(history):
            continue
        if n > best:
            best, who = n, {session}
        elif n == best:
            who.add(session)
    return best, who
