"""Audit anchors: HMAC-SHA256 checkpoints of audit chain heads, kept outside the database they protect.

An anchor says "at ts_us, chain c ended at record seq s whose hash was h" for the chains it lists,
sealed with an HMAC under a key that lives only in a file (never in SQL, never in the store). Each
anchor also carries the previous anchor's MAC and its own index `n` (1, 2, ...), so the anchors of one
node form a MAC chain: without the key nobody can forge, edit, reorder or drop one from the middle of
that chain undetected. Copies live in an append-only file per node (`AnchorFile`) and in the store's
database (`RocksAuditSink.put_anchors`). Knows nothing of what the chains hold; `check_claims` is
given the chains' current heads and a way to read a record's hash.

References: RFC 2104 (HMAC), the hash chain format of audit_record.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storage.audit_record import GENESIS_HASH, canonical_json

__all__ = [
    "ANCHOR_VERSION",
    "MIN_ANCHOR_KEY_BYTES",
    "Anchor",
    "AnchorFile",
    "AnchorKey",
    "check_anchor_chain",
    "check_claims",
    "seal_anchor",
]

ANCHOR_VERSION = 1
MIN_ANCHOR_KEY_BYTES = 16
"""Shortest key accepted: HMAC-SHA256 keys below 128 bits are guessable in principle (RFC 2104 §3)."""


@dataclass(frozen=True)
class AnchorKey:
    """The anchor key (secret bytes) and its public id (a hash of it, so verify can say which key an
    anchor was made with without revealing it). `repr` hides the secret."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_ANCHOR_KEY_BYTES:
            raise ValueError(
                f"audit anchor key has {len(self.secret)} bytes, needs at least {MIN_ANCHOR_KEY_BYTES}"
            )

    @property
    def key_id(self) -> str:
        return hashlib.sha256(b"kvresume-audit-anchor-key\x00" + self.secret).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: Path | str) -> AnchorKey:
        """Read the key file: its bytes without trailing whitespace (a line written by `openssl rand
        -hex 32 > key` is a 64-byte key).

        Raises:
            ValueError: the file is missing, unreadable or holds fewer than MIN_ANCHOR_KEY_BYTES bytes.
        """
        try:
            raw = Path(path).read_bytes().rstrip()
        except OSError as exc:
            raise ValueError(f"audit_anchor_key_file={str(path)!r} cannot be read: {exc}") from exc
        try:
            return cls(raw)
        except ValueError as exc:
            raise ValueError(f"audit_anchor_key_file={str(path)!r}: {exc}") from exc

    def mac(self, body: bytes) -> str:
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()

    def verifies(self, anchor: Anchor) -> bool:
        """True when `anchor` was made with this key and is unchanged since."""
        return anchor.key_id == self.key_id and hmac.compare_digest(self.mac(anchor.body()), anchor.mac)


@dataclass(frozen=True, kw_only=True)
class Anchor:
    """One sealed checkpoint of chain heads.

    Args:
        node: the node that wrote it (one anchor chain per node).
        n: its index in the node's anchor chain, 1, 2, ... without gaps.
        ts_us: when it was made (microseconds since the epoch).
        heads: chain name -> (seq, hash) of that chain's newest record when the anchor was made, for
            the chains whose head moved since the previous anchor (all chains in the first one).
        prev_mac: the previous anchor's mac (GENESIS_HASH for n = 1).
        key_id: AnchorKey.key_id of the key that made `mac`.
        mac: HMAC-SHA256 under the key of the canonical JSON of every other field.
    """

    node: str
    n: int
    ts_us: int
    heads: dict[str, tuple[int, str]]
    prev_mac: str
    key_id: str
    mac: str = ""

    def body(self) -> bytes:
        return canonical_json(
            {
                "version": ANCHOR_VERSION,
                "node": self.node,
                "n": self.n,
                "ts_us": self.ts_us,
                "heads": {c: [s, h] for c, (s, h) in sorted(self.heads.items())},
                "prev_mac": self.prev_mac,
                "key_id": self.key_id,
            }
        )

    def to_json(self) -> bytes:
        """One line of the anchor file (no newline); `from_json` inverts it."""
        obj = json.loads(self.body())
        obj["mac"] = self.mac
        return canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes | str) -> Anchor:
        """Raises: ValueError when the data is not an anchor of this version with exactly its fields."""
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"anchor is not JSON: {exc}") from exc
        names = {"version", "node", "n", "ts_us", "heads", "prev_mac", "key_id", "mac"}
        if not isinstance(obj, dict) or set(obj) != names or obj["version"] != ANCHOR_VERSION:
            raise ValueError(f"anchor must be a version-{ANCHOR_VERSION} object with fields {sorted(names)}")
        heads = obj["heads"]
        if not isinstance(heads, dict) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
            for v in heads.values()
        ):
            raise ValueError(f"anchor heads must map chain -> [seq, hash], got {heads!r}")
        return cls(
            node=str(obj["node"]),
            n=int(obj["n"]),
            ts_us=int(obj["ts_us"]),
            heads={str(c): (int(v[0]), str(v[1])) for c, v in heads.items()},
            prev_mac=str(obj["prev_mac"]),
            key_id=str(obj["key_id"]),
            mac=str(obj["mac"]),
        )


def seal_anchor(
    key: AnchorKey, *, node: str, previous: Anchor | None, ts_us: int, heads: dict[str, tuple[int, str]]
) -> Anchor:
    """The next anchor after `previous` (None: the first), MAC'd under `key`."""
    unsealed = Anchor(
        node=node,
        n=1 if previous is None else previous.n + 1,
        ts_us=ts_us,
        heads=dict(heads),
        prev_mac=GENESIS_HASH if previous is None else previous.mac,
        key_id=key.key_id,
    )
    return Anchor(**{**unsealed.__dict__, "mac": key.mac(unsealed.body())})


def check_anchor_chain(anchors: Sequence[Anchor], key: AnchorKey) -> list[str]:
    """Problems of one node's anchor chain, in order (empty when every MAC verifies and the chain
    runs n = 1, 2, ... with each prev_mac equal to the previous anchor's mac)."""
    problems: list[str] = []
    prev = GENESIS_HASH
    for i, anchor in enumerate(anchors, start=1):
        if anchor.key_id != key.key_id:
            problems.append(f"anchor n={anchor.n} was made with key {anchor.key_id}, not {key.key_id}")
            return problems
        if not key.verifies(anchor):
            problems.append(f"anchor n={anchor.n} has a bad MAC (edited or forged)")
            return problems
        if anchor.n != i:
            problems.append(f"anchor n={anchor.n} found where n={i} was expected (anchors removed)")
            return problems
        if anchor.prev_mac != prev:
            problems.append(f"anchor n={anchor.n} does not follow anchor n={i - 1}")
            return problems
        prev = anchor.mac
    return problems


def check_claims(
    anchors: Iterable[Anchor],
    *,
    heads: dict[str, tuple[int, str]],
    hash_at: Callable[[str, int], str | None],
    skip: Callable[[str], bool] = lambda chain: False,
) -> list[str]:
    """Problems of the chains against what MAC-verified anchors say about them.

    For every (chain, seq, hash) an anchor lists: the chain must still reach seq (else records were
    cut, or the chain wiped and restarted), and its record at seq must still have that hash (else the
    chain was rewritten and re-hashed). `hash_at(chain, seq)` is the stored record's hash or None;
    `skip(chain)` leaves out chains the caller cannot check (another store's chain).
    """
    problems: list[str] = []
    for anchor in anchors:
        for chain, (seq, h) in anchor.heads.items():
            if skip(chain) or seq <= 0:
                continue
            if hash_at(chain, seq) != h:
                head_seq = heads.get(chain, (0, GENESIS_HASH))[0]
                if head_seq < seq:
                    problems.append(
                        f"chain {chain!r} ends at seq {head_seq}, but anchor n={anchor.n} saw it at seq {seq}"
                    )
                else:
                    problems.append(
                        f"chain {chain!r} record seq {seq} differs from anchor n={anchor.n} (rewritten)"
                    )
    return problems


class AnchorFile:
    """Append-only JSON-lines file of one node's anchors; every append is fsynced before it returns."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def append(self, anchors: Sequence[Anchor]) -> None:
        if not anchors:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(a.to_json() + b"\n" for a in anchors)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> tuple[list[Anchor], list[str]]:
        """(the anchors in file order, problems: lines that do not decode, a torn last line)."""
        if not self.path.exists():
            return [], []
        anchors: list[Anchor] = []
        problems: list[str] = []
        *lines, tail = self.path.read_bytes().split(b"\n")
        for number, line in enumerate(lines, start=1):
            try:
                anchors.append(Anchor.from_json(line))
            except ValueError as exc:
                problems.append(f"{self.path.name} line {number}: {exc}")
        if tail:
            problems.append(f"{self.path.name}: torn last line ({len(tail)} bytes without a newline)")
        return anchors, problems

    def drop_torn_tail(self) -> int:
        """Cut a last line without its newline (an append a crash interrupted before its fsync
        returned, so no anchor in it was ever reported written); returns the bytes cut. The only
        change to the file other than an append."""
        if not self.path.exists():
            return 0
        raw = self.path.read_bytes()
        keep = raw.rfind(b"\n") + 1
        if keep == len(raw):
            return 0
        with open(self.path, "r+b") as fh:
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())
        return len(raw) - keep
