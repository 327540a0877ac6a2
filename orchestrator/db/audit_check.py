"""The whole audit check: every SQL chain, the store's own chain, their agreement, and the HMAC anchors
of both held outside the databases (storage/audit_anchor.py), plus the writer of those anchors.

What is detected, and under which assumption, is stated in storage/README.md ("What verify proves").
Knows nothing of the service; the node wires one `AuditChecker` (orchestrator/engine/service.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from orchestrator.db.audit_sink import ChainVerdict, SqlAuditSink
from storage import (
    GENESIS_HASH,
    Anchor,
    AnchorFile,
    AnchorKey,
    AuditRecord,
    RocksAuditSink,
    check_anchor_chain,
    check_claims,
    seal_anchor,
    verify_chain,
)

__all__ = ["STORE_CHAIN_PREFIX", "AuditChecker", "AuditReport", "store_chain_name"]

log = structlog.get_logger(__name__)

STORE_CHAIN_PREFIX = "@store/"
"""Anchors name the store's chain by this prefix and its identity (a store started afresh has another)."""

# The fields a mirrored SQL record copies from its store record (seq and hashes are the SQL chain's own).
_MIRRORED = ("ts_us", "actor", "action", "tenant", "subject", "reason", "nbytes")


def store_chain_name(first_hash: str) -> str:
    return STORE_CHAIN_PREFIX + first_hash[:16]


@dataclass(frozen=True, kw_only=True)
class AuditReport:
    """The outcome of `AuditChecker.verify`.

    `verdict` is "ok" (everything checked and the anchors verified), "unanchored" (everything that can
    be checked without the key passed) or "broken" (see `sql`, `store` and `problems`).
    """

    verdict: str
    sql: list[ChainVerdict]
    store: ChainVerdict | None
    problems: list[str] = field(default_factory=list)
    anchors: int = 0
    store_pending: int = 0

    @property
    def ok(self) -> bool:
        return self.verdict != "broken"


@dataclass(frozen=True, kw_only=True)
class _AnchorCopies:
    """One consistent read of both anchor copies, and the lines/entries that did not decode."""

    in_file: list[Anchor]
    bad_lines: list[str]
    in_store: list[Anchor]
    bad_entries: list[str]


class AuditChecker:
    """Verifies the audit log and, given a key, writes its anchors.

    Args:
        sql: the authoritative SQL log.
        store_audit: the store's chain (None: no store in this process).
        store_acked_seq: the store seq up to which the SQL log acknowledged every record; records
            after it may be missing from SQL while their delivery is under way.
        anchor_file: this node's append-only anchor file (None with no key).
        key: the anchor key (None: nothing is anchored and verify says "unanchored").
        node: this node's name, written in its anchors.
        interval_s: how often `start` anchors; verify reports anchors older than three intervals as
            stale while this checker's writer runs (the newest anchors were removed).
        live_store: the store is open and being written (the node's own); False for a store read
            offline (`admin audit-local`).
    """

    def __init__(
        self,
        sql: SqlAuditSink,
        *,
        store_audit: RocksAuditSink | None = None,
        store_acked_seq: Callable[[], int] = lambda: 0,
        anchor_file: AnchorFile | None = None,
        key: AnchorKey | None = None,
        node: str = "",
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        live_store: bool = True,
    ) -> None:
        if key is not None and anchor_file is None:
            raise ValueError("an anchor key needs an anchor file")
        if not interval_s > 0:
            raise ValueError(f"audit_anchor_interval_s={interval_s} must be > 0")
        self._sql = sql
        self._store = store_audit
        self._live = live_store
        self._acked = store_acked_seq
        self._file = anchor_file
        self._key = key
        self._node = node
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: Anchor | None = None
        self._known: dict[str, tuple[int, str]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def anchored(self) -> bool:
        return self._key is not None

    # ----- anchoring

    def _chain_heads(self) -> dict[str, tuple[int, str]]:
        heads = {c: h for c, h in self._sql.heads().items() if h[0] > 0}
        if self._store is not None:
            first = self._store.first_hash()
            if first is not None:
                heads[store_chain_name(first)] = self._store.head()
        return heads

    def restore(self) -> None:
        """At start: cut a torn file tail, then make the file and the store hold the same anchors (a
        crash between the two writes leaves one of them an anchor short; a fresh store has none), and
        continue the chain after the newest one. Copies that fail their MAC chain are left as they
        are for verify to report, and the chain continues after the file's copy."""
        if self._key is None or self._file is None:
            return
        with self._lock:
            cut = self._file.drop_torn_tail()
            if cut:
                log.warning("audit_anchor_torn_tail_cut", path=str(self._file.path), nbytes=cut)
            in_file, _ = self._file.read()
            in_store = self._store.anchors()[0] if self._store is not None else []
            file_ok = not check_anchor_chain(in_file, self._key)
            store_ok = not check_anchor_chain(in_store, self._key)
            longer, shorter = (in_file, in_store) if len(in_file) >= len(in_store) else (in_store, in_file)
            if file_ok and store_ok and longer[: len(shorter)] == shorter:
                missing = longer[len(shorter) :]
                if missing and longer is in_file and self._store is not None:
                    self._store.put_anchors(missing)
                elif missing and longer is in_store:
                    self._file.append(missing)
                if missing:
                    where = "store" if longer is in_file else "file"
                    log.info("audit_anchors_copied", anchors=len(missing), to=where)
                chain = longer
            else:
                log.error("audit_anchor_copies_disagree", file=len(in_file), store=len(in_store))
                chain = in_file
            self._last = chain[-1] if chain else None
            self._known = {}
            for anchor in chain:
                self._known.update(anchor.heads)

    def anchor(self) -> Anchor | None:
        """Write one anchor of every chain whose head moved since the last one (every chain in the
        first): to the file (fsynced), then to the store. None without a key."""
        if self._key is None or self._file is None:
            return None
        with self._lock:
            heads = self._chain_heads()
            moved = {c: h for c, h in heads.items() if self._known.get(c) != h}
            anchor = seal_anchor(
                self._key,
                node=self._node,
                previous=self._last,
                ts_us=int(round(self._clock() * 1_000_000)),
                heads=moved,
            )
            self._file.append([anchor])
            if self._store is not None:
                self._store.put_anchors([anchor])
            self._last = anchor
            self._known.update(moved)
            return anchor

    def start(self) -> None:
        """Anchor now and then every interval on a daemon thread (nothing without a key)."""
        if self._key is None or self._thread is not None:
            return
        self.restore()
        self.anchor()
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self._interval):
                try:
                    self.anchor()
                except Exception as exc:  # noqa: BLE001 - a full disk must not end the anchoring for good
                    log.error("audit_anchor_failed", error=str(exc))

        self._thread = threading.Thread(target=loop, name="audit-anchor", daemon=True)
        self._thread.start()

    def stop(self, *, final: bool = True) -> None:
        """Stop the writer; `final` writes one last anchor (a clean shutdown leaves no unanchored tail)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        if final:
            try:
                self.anchor()
            except Exception as exc:  # noqa: BLE001 - shutting down after an I/O error must not raise
                log.error("audit_anchor_failed", error=str(exc))

    # ----- verification

    def verify(self) -> AuditReport:
        """Walk every chain, compare the store's records with their SQL mirrors, check the anchors."""
        problems: list[str] = []
        sql_hashes: dict[str, dict[int, str]] = {}
        verdicts: list[ChainVerdict] = []
        # The anchors before any chain: chains only grow, so an anchor read first never claims a head
        # past what the chain reads below see (read after them, one written meanwhile could).
        copies = self._read_anchors() if self._key is not None and self._file is not None else None
        # The store first: its records are mirrored into SQL after their batch, so a snapshot of SQL
        # taken later holds every mirror of what the store snapshot acknowledges.
        store_verdict: ChainVerdict | None = None
        store_name = ""
        store_records: list[AuditRecord] = []
        acked = 0
        read_at_us = int(self._clock() * 1_000_000)
        if self._store is not None:
            acked = self._acked()
            seq, h = self._store.head()
            store_records = [r for r in self._store.iter_decodable() if r.seq <= seq or not self._live]
            # A live store may append during the walk: check it against the head read first. A store
            # read offline does not change, and a record past its head is then a break.
            result = self._store.verify(head=(seq, h) if self._live else None)
            first = self._store.first_hash()
            store_name = store_chain_name(first) if first is not None else STORE_CHAIN_PREFIX
            store_verdict = ChainVerdict(chain=store_name, head_seq=seq, head_hash=h, result=result)
        heads, by_chain = self._sql.snapshot()
        mirrors: dict[str, AuditRecord] = {}
        for chain in sorted(by_chain):
            head = heads.get(chain, (0, GENESIS_HASH))
            records = by_chain[chain]
            result = verify_chain(records, head=head)
            verdicts.append(ChainVerdict(chain=chain, head_seq=head[0], head_hash=head[1], result=result))
            sql_hashes[chain] = {r.seq: r.hash for r in records}
        mirrors.update(self._sql.mirrored())
        pending = 0
        store_hashes: dict[int, str] = {}
        if self._store is not None:
            store_hashes = {r.seq: r.hash for r in store_records}
            pending = self._agreement(store_records, mirrors, problems, acked, read_at_us)
        anchors = 0
        if copies is not None:
            all_heads = dict(heads)
            if store_verdict is not None:
                all_heads[store_name] = (store_verdict.head_seq, store_verdict.head_hash)
                sql_hashes[store_name] = store_hashes
            anchors = self._check_anchors(
                problems, copies, heads=all_heads, hashes=sql_hashes, store_name=store_name
            )
        chains_ok = all(v.result.ok for v in verdicts) and (store_verdict is None or store_verdict.result.ok)
        if not chains_ok or problems:
            verdict = "broken"
        else:
            verdict = "ok" if self._key is not None else "unanchored"
        return AuditReport(
            verdict=verdict,
            sql=verdicts,
            store=store_verdict,
            problems=problems,
            anchors=anchors,
            store_pending=pending,
        )

    @staticmethod
    def _agreement(
        store_records: list[AuditRecord],
        mirrors: dict[str, AuditRecord],
        problems: list[str],
        acked: int,
        read_at_us: int,
    ) -> int:
        """Every store record the SQL log acknowledged (seq <= `acked`) has a mirror with the same
        fields; every mirror stamped between this store's first record and `read_at_us` (the clock
        before the store was read: a record appended later is stamped later) names one of its records.
        Returns the records pending delivery."""
        pending = 0
        held = {r.hash for r in store_records}
        for rec in store_records:
            mirror = mirrors.get(rec.hash)
            if mirror is None:
                if rec.seq <= acked:
                    problems.append(f"store record seq {rec.seq} ({rec.action}) is missing from the SQL log")
                else:
                    pending += 1
                continue
            differ = [f for f in _MIRRORED if getattr(mirror, f) != getattr(rec, f)]
            if differ:
                problems.append(
                    f"store record seq {rec.seq} and its SQL mirror (chain {mirror.tenant!r} seq "
                    f"{mirror.seq}) differ in {', '.join(differ)}"
                )
        since = store_records[0].ts_us if store_records else None
        if since is not None:
            for source_hash, mirror in mirrors.items():
                if since <= mirror.ts_us < read_at_us and source_hash not in held:
                    problems.append(
                        f"SQL record (chain {mirror.tenant!r} seq {mirror.seq}) mirrors a store record "
                        "the store does not hold"
                    )
        return pending

    def _read_anchors(self) -> _AnchorCopies:
        """Both anchor copies, read under the writer's lock (it writes the file, then the store: a read
        between the two would see the copies disagree)."""
        assert self._file is not None
        with self._lock:
            in_file, bad_lines = self._file.read()
            in_store, bad_entries = self._store.anchors() if self._store is not None else ([], [])
        return _AnchorCopies(in_file=in_file, bad_lines=bad_lines, in_store=in_store, bad_entries=bad_entries)

    def _check_anchors(
        self,
        problems: list[str],
        copies: _AnchorCopies,
        *,
        heads: dict[str, tuple[int, str]],
        hashes: dict[str, dict[int, str]],
        store_name: str,
    ) -> int:
        assert self._key is not None
        in_file, in_store = copies.in_file, copies.in_store
        problems.extend(copies.bad_lines)
        problems.extend(f"anchor file: {p}" for p in check_anchor_chain(in_file, self._key))
        if self._store is not None:
            problems.extend(copies.bad_entries)
            problems.extend(f"store anchors: {p}" for p in check_anchor_chain(in_store, self._key))
            if in_store != in_file:
                only_store = {a.n for a in in_store} - {a.n for a in in_file}
                only_file = {a.n for a in in_file} - {a.n for a in in_store}
                problems.append(
                    f"anchor copies disagree: the file holds {len(in_file)}, the store {len(in_store)} (only "
                    f"in the store: n={sorted(only_store)[:8]}, only in the file: n={sorted(only_file)[:8]})"
                )
        # Claims come only from anchors whose MAC verifies, from either copy (one copy's removed
        # anchors still vouch for the chains through the other).
        trusted = {a.mac: a for a in [*in_file, *in_store] if self._key.verifies(a)}
        problems.extend(
            check_claims(
                sorted(trusted.values(), key=lambda a: a.n),
                heads=heads,
                hash_at=lambda chain, seq: hashes.get(chain, {}).get(seq),
                # Anchors of an earlier store (replaced after damage) name a chain that no longer exists.
                skip=lambda chain: chain.startswith(STORE_CHAIN_PREFIX) and chain != store_name,
            )
        )
        if self._thread is not None and not in_file:
            problems.append("no anchors, yet the writer anchored when it started (the anchors were removed)")
        if self._thread is not None and in_file:
            age_s = self._clock() - in_file[-1].ts_us / 1e6
            if age_s > 3 * self._interval:
                problems.append(
                    f"the newest anchor (n={in_file[-1].n}) is {age_s:.0f} s old while anchors are written "
                    f"every {self._interval:g} s (newer ones were removed, or writing them fails: see "
                    "audit_anchor_failed in the log)"
                )
        return len(in_file)
