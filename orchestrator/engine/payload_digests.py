"""sha256 digests of verified chunk payloads, kept by the stored checksum each payload verified against, so
that a turn does not hash again the unchanged chunks of its history that the previous turn hashed.

Exact, not a heuristic: a stored chunk value is header, payload and sha256 over both, and the store serves
a payload only after that checksum verified (`GlobalKVStore.longest_valid_prefix`). Two values with the
same checksum are the same bytes (sha256 collision resistance, which the chunk addresses and every digest
here already rely on), so the same payload, so the same payload digest. A checksum never seen (a chunk
written anew, another writer's bytes of the same tokens) is a miss and is hashed. Knows nothing of what
the digests are for (`pool_entry.chunks_digest_of`, `DecodedStates.matches`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PayloadDigests", "payload_digests_reference"]


def payload_digests_reference(payloads: Sequence[bytes]) -> list[bytes]:
    """The slow twin of `PayloadDigests.of`: every payload hashed."""
    return [hashlib.sha256(p).digest() for p in payloads]


class PayloadDigests:
    """Thread-safe LRU of payload sha256 digests by verified value checksum.

    Args:
        max_entries: most digests kept (about 150 bytes each); 0 keeps none (every call hashes).
    """

    def __init__(self, max_entries: int = 1 << 16) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must be >= 0")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, bytes] = OrderedDict()
        self.hits = self.misses = 0

    def of(self, payloads: Sequence[bytes], checksums: Sequence[bytes]) -> list[bytes]:
        """sha256 of each payload; `checksums[i]` is the stored checksum payloads[i] verified against
        (`PrefixResult.checksums`, same order).

        Raises:
            ValueError: the two lists differ in length.
        """
        if len(payloads) != len(checksums):
            raise ValueError(f"{len(payloads)} payloads but {len(checksums)} checksums")
        out: list[bytes] = []
        for payload, checksum in zip(payloads, checksums, strict=True):
            with self._lock:
                digest = self._kept.get(checksum)
                if digest is not None:
                    self._kept.move_to_end(checksum)
                    self.hits += 1
            if digest is None:
                digest = hashlib.sha256(payload).digest()
                self._keep(checksum, digest)
            out.append(digest)
        return out

    def known(self, checksums: Sequence[bytes]) -> list[bytes] | None:
        """The kept payload digests of these value checksums, in order, or None when any is not kept
        (nothing is hashed: there is no payload here to hash)."""
        out: list[bytes] = []
        with self._lock:
            for checksum in checksums:
                digest = self._kept.get(checksum)
                if digest is None:
                    return None
                self._kept.move_to_end(checksum)
                out.append(digest)
            self.hits += len(out)
        return out

    def remember(self, checksum: bytes, digest: bytes) -> None:
        """Keep `digest`, the sha256 of the payload of a value the caller just wrote whose stored checksum
        is `checksum` (`PutResult.written`): the next turn then knows it without reading the value."""
        with self._lock:
            if self.max_entries == 0:
                return
            self._kept[checksum] = digest
            self._kept.move_to_end(checksum)
            while len(self._kept) > self.max_entries:
                self._kept.popitem(last=False)

    def _keep(self, checksum: bytes, digest: bytes) -> None:
        with self._lock:
            self.misses += 1
        self.remember(checksum, digest)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
