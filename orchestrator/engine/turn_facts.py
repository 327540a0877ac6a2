"""A turn's facts before it runs: the session, history and policy from the registry, the longest usable
stored prefix of the receiver's prompt and the pooled windows of a prompt prefix, both found by content
(`prefix_reuse.py`; of the sender's history on a model switch), the usable mappers, and the plan
`plan_turn` chooses over them.

Knows nothing of executing a plan (`turn_engine.py`). Store reads happen outside any SQL transaction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy.orm import Session

from orchestrator.api import (
    InvalidRequestError,
    NotFoundError,
    PreconditionError,
    ServiceContext,
    TurnInput,
)
from orchestrator.db import (
    EffectivePolicy,
    MapperRepository,
    PolicyRepository,
    RetainedKeys,
    SegmentRepository,
    SessionRepository,
    TurnReads,
    TurnSnapshot,
    session_view,
)
from orchestrator.db.models import SessionStatus, blob_to_tokens
from orchestrator.engine.decoded_states import DecodedStates
from orchestrator.engine.global_kv import StoredPrefix, read_prefix
from orchestrator.engine.model_catalog import served_or_not_found
from orchestrator.engine.model_compute import ModelCompute
from orchestrator.engine.payload_digests import PayloadDigests
from orchestrator.engine.prefix_reuse import find_reuse, lookup_result
from orchestrator.engine.served_models import ModelRegistry, ServedModel
from orchestrator.engine.swap import KVMapperApplier, MapperArtifact
from orchestrator.planner import CacheInventory, CostTable, MapperInfo, Plan, ResumePath, plan_turn
from storage import GlobalKVStore, WindowPool, largest_id

__all__ = ["TurnFacts", "TurnPreparation"]


@dataclass(frozen=True, kw_only=True)
class TurnFacts:
    """A turn's facts before it runs: the session as read (plain values; the ORM row stays inside its
    session), the stored prefixes and pool state it may resume from, and the plan chosen over them.

    Attributes:
        prefix: the receiver's longest usable stored prefix of the prompt (found by content; what a
            GLOBAL_REPLAY loads).
        own_stored: this session's own contiguous stored prefix of the receiver, within what the plan
            loads (full chunks below it need not be written again).
        full_hit_state: the receiver state with pooled windows imported (None unless windows found by
            content continue a stored prefix of the prompt exactly; what a FULL_HIT continues).
        reused: the verified payloads, by range, of the stored chunks the plan loads: at turn end the
            session stores (and so links, in the store and the registry) its history's chunks from these
            instead of exporting them again; `reused_hashes`, their sha256 (for the chunks digest).
        content_source: the session whose pooled windows a FULL_HIT continues (None otherwise).
        artifacts: mapper artifacts the plan may name, by mapper id.
    """

    session_id: str
    tenant_id: str
    turn_count: int
    retention_s: float
    history: list[int]
    history_ids: bytes
    plan: Plan
    served: ServedModel
    new_tokens: list[int]
    prefix: StoredPrefix
    own_stored: int
    sender_prefix: StoredPrefix | None
    sender: ServedModel | None
    full_hit_state: Any | None
    artifacts: dict[str, MapperArtifact]
    reused: dict[tuple[int, int], bytes] = dataclasses.field(default_factory=dict)
    reused_hashes: dict[tuple[int, int], bytes] = dataclasses.field(default_factory=dict)
    content_source: str | None = None


class TurnPreparation:
    """Gathers a turn's facts and plans it (see the module docstring)."""

    def __init__(
        self,
        *,
        ctx: ServiceContext,
        registry: ModelRegistry,
        store: GlobalKVStore,
        pool: WindowPool,
        costs: CostTable,
        mappers: KVMapperApplier,
        compute: ModelCompute,
        decoded: DecodedStates | None = None,
        digests: PayloadDigests | None = None,
    ) -> None:
        self._ctx = ctx
        self.decoded = decoded
        self.digests = digests
        self._retained = RetainedKeys(ctx.sessions)
        self._turn_reads = TurnReads(ctx.sessions)
        self.registry = registry
        self.store = store
        self.pool = pool
        self.costs = costs
        self.mappers = mappers
        self.compute = compute
        # A full hit continuing this session's own kept decoded state proves its chunks from the index,
        # the registry and kept digests, without reading them (`read_prefix(payloads_optional=...)`);
        # False reads and verifies every chunk each turn, its twin (tests and benchmarks compare them).
        self.kept_state_skips_reads = True

    def _served(self, name: str) -> ServedModel:
        return served_or_not_found(self.registry, name)

    def _new_tokens(self, turn: TurnInput, served: ServedModel) -> list[int]:
        if turn.tokens is not None:
            tokens = list(turn.tokens)
        else:
            assert turn.text is not None
            tokens = served.codec.encode(turn.text)
            if not tokens:
                raise InvalidRequestError(
                    f"text of turn for session {turn.session_id} encodes to no tokens", field="text"
                )
        vocab = served.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary of {served.name} (size {served.vocab_size})",
                reason="TOKEN_OUT_OF_VOCABULARY",
                field="tokens",
            )
        return tokens

    def _content_sender(
        self,
        turn: TurnInput,
        served: ServedModel,
        prompt: list[int],
        own: StoredPrefix,
        candidates: list[tuple[MapperArtifact, MapperInfo]],
    ) -> tuple[ServedModel | None, StoredPrefix | None]:
        """For a new session: the served model, with a usable validated mapper to `served`, whose stored
        prefix of the prompt (found by content) is the longest and longer than `own`, and that prefix
        read and verified; (None, None) when there is none. The store's index is asked first (no
        payload read), so only the chosen model's chunks are read."""
        probe = prompt[:-1]
        best: tuple[int, ServedModel] | None = None
        for name in sorted({art.sender_model for art, _ in candidates}):
            sender = self.registry.get(name)
            if sender is None or not any(
                art.sender_model == name and self.mappers.usable(art, sender, served) for art, _ in candidates
            ):
                continue
            n = self.store.lookup(turn.tenant_id, sender.fingerprint_hex, probe).n_tokens
            if n > own.n_tokens and (best is None or n > best[0]):
                best = (n, sender)
        if best is None:
            return None, None
        sender = best[1]
        read = read_prefix(
            self.store,
            self._ctx.sessions,
            tenant=turn.tenant_id,
            served=sender,
            history=probe,
            compute=self.compute,
        )
        if read.n_tokens == 0:
            return None, None
        return sender, read

    def _registered(self, turn: TurnInput, reads: _SessionReads | _SnapshotReads) -> _Registered:
        """The turn's registry facts from `reads`, checked (see `prepare`)."""
        row = reads.facts(turn.session_id, tenant_id=turn.tenant_id)
        if row is None:
            raise NotFoundError(f"session {turn.session_id} not found")
        if row.status != SessionStatus.OPEN:
            raise PreconditionError(f"session {row.id} is closed", reason="SESSION_CLOSED")
        name = turn.model or row.model
        served = self._served(name)
        new_tokens = self._new_tokens(turn, served)
        history = reads.history(row.id)
        history_ids = reads.history_ids(history)
        if len(history) != row.history_tokens:
            raise PreconditionError(
                f"session {row.id}: its turns hold {len(history)} history tokens, "
                f"the row says {row.history_tokens}"
            )
        if history and largest_id(history_ids) >= served.vocab_size:
            # a switch to a model with a smaller vocabulary cannot read this history
            raise InvalidRequestError(
                f"session {row.id}'s history holds token id {max(history)}, outside the vocabulary of "
                f"{served.name} (size {served.vocab_size})",
                reason="TOKEN_OUT_OF_VOCABULARY",
                field="model",
            )
        view = session_view(row, new_tokens=len(new_tokens))
        policy = reads.policy(row.tenant_id)
        own_stored = 0
        # Chunks of this model computed under another fingerprint: other weights, or another
        # numerics profile (another node's CPU path or kernels); either way a miss here.
        foreign: set[str] = set()
        for seg in reads.spans(row.id):
            if seg.fingerprint == served.fingerprint_hex and seg.start_pos == own_stored:
                own_stored = seg.end_pos
            elif seg.model == name and seg.fingerprint != served.fingerprint_hex:
                foreign.add(seg.numerics)
        last = view.last_model
        candidates: list[tuple[MapperArtifact, MapperInfo]] = []
        # On a switch, the last model's mappers; for a new session, every model's mapper to this one:
        # its prompt may be stored under another model (found by content; the model-swap rules apply).
        mapper_rows = []
        if last is not None and last != name:
            mapper_rows = reads.mappers(sender_model=last, receiver_model=name)
        elif not history:
            mapper_rows = [m for m in reads.mappers(receiver_model=name) if m.sender_model != name]
        if mapper_rows:
            for m in mapper_rows:
                if not m.passed_gate:
                    continue
                art = MapperArtifact(
                    mapper_id=m.id,
                    sender_model=m.sender_model,
                    receiver_model=m.receiver_model,
                    artifact_uri=m.artifact_uri,
                    artifact_sha256=m.artifact_sha256,
                    kind=m.kind,
                )
                score = float(m.metrics.get(m.gate_metric, 0.0)) if m.gate_metric else 0.0
                info = MapperInfo(
                    mapper_id=m.id,
                    sender_model=m.sender_model,
                    receiver_model=m.receiver_model,
                    passed_gate=True,
                    score=score,
                    retention=float(m.metrics["retention"]) if "retention" in m.metrics else None,
                )
                candidates.append((art, info))
        facts = dict(
            session_id=row.id,
            tenant_id=row.tenant_id,
            turn_count=row.turn_count,
            retention_s=min(row.retention_s, policy.ceiling_s),
        )
        return _Registered(
            name,
            served,
            new_tokens,
            history,
            history_ids,
            view,
            policy,
            own_stored,
            foreign,
            last,
            candidates,
            row.id,
            facts,
        )

    def prepare(self, turn: TurnInput) -> TurnFacts:
        """Read the session, its stored KV and pool entry, and plan the turn.

        Raises:
            NotFoundError: unknown session or model; PreconditionError: closed or inconsistent session;
            InvalidRequestError: token ids outside the vocabulary or text that encodes to nothing.
        """
        ctx = self._ctx
        settings = ctx.settings
        # The session, its history, the tenant's policy, the session's segments and (a switch, a new
        # session) the mappers to the turn's model in one read transaction, Core rows (no ORM objects):
        # on SQLite through the driver (`TurnReads`), elsewhere in one Session.
        snapshot = self._turn_reads.read(
            turn.session_id,
            tenant_id=turn.tenant_id,
            default_floor_s=settings.retention_floor_s,
            default_ceiling_s=settings.retention_ceiling_s,
            model=turn.model,
        )
        if snapshot is not None:
            reg = self._registered(turn, _SnapshotReads(snapshot))
        else:
            with ctx.sessions() as s:
                reg = self._registered(turn, _SessionReads(s, turn.tenant_id, settings))
        # Store reads happen outside any SQL transaction: a store call may deliver audit records to the
        # SQL sink, so holding a SQLite write lock across it could wait on itself.
        reuse = find_reuse(
            self.store,
            self.pool,
            ctx.sessions,
            self.compute,
            tenant=turn.tenant_id,
            session_id=reg.row_id,
            served=reg.served,
            history=reg.history,
            new_tokens=reg.new_tokens,
            last_model=reg.last,
            history_ids=reg.history_ids,
            decoded=self.decoded,
            digests=self.digests,
            retained=self._retained,
            kept_state_skips_reads=self.kept_state_skips_reads,
        )
        prefix = reuse.prefix
        if reg.foreign and prefix.n_tokens < len(reg.history):
            prefix = dataclasses.replace(prefix, miss_reason=_foreign_reason(reg.served, reg.foreign, prefix))
        sender = sender_prefix = None
        infos: list[MapperInfo] = []
        artifacts: dict[str, MapperArtifact] = {}
        if reg.last is not None and reg.last != reg.name:
            sender = self.registry.get(reg.last)
            if sender is not None:
                sender_prefix = read_prefix(
                    self.store,
                    ctx.sessions,
                    tenant=turn.tenant_id,
                    served=sender,
                    history=reg.history,
                    compute=self.compute,
                    history_ids=reg.history_ids,
                )
                for art, info in reg.candidates:
                    # A mapper that cannot run on this node is as good as none: plan without it.
                    if self.mappers.usable(art, sender, reg.served):
                        artifacts[art.mapper_id] = art
                        infos.append(info)
        elif reg.candidates:
            sender, sender_prefix = self._content_sender(
                turn, reg.served, reg.history + reg.new_tokens, prefix, reg.candidates
            )
            if sender is not None:
                for art, info in reg.candidates:
                    if art.sender_model == sender.name:
                        artifacts[art.mapper_id] = art
                        infos.append(info)
        if reg.history:
            # The metric counts lookups of a history (hit: all of it stored); a new session's lookup of its
            # prompt by content shows in its plan's reason and counts instead.
            ctx.metrics.child(ctx.metrics.cache_lookups, result=lookup_result(prefix, len(reg.history))).inc()
        region = self.store.config.region
        may_persist = reg.policy.may_store_in(region)
        note = (
            ""
            if may_persist
            else f"residency: tenant {turn.tenant_id} allows regions {list(reg.policy.allowed_regions)}, "
            f"this node is in {region!r}; served without persisting"
        )
        inventory = dataclasses.replace(prefix.inventory(), own_prefix=min(reg.own_stored, prefix.n_tokens))
        plan = plan_turn(
            reg.view,
            model=reg.name,
            geometry=reg.served.geometry,
            cache=inventory,
            sender_cache=_sender_inventory(sender_prefix, new_session=not reg.history),
            pool=reuse.pool,
            pooled=reuse.pooled,
            mappers=infos,
            costs=self.costs.for_model(reg.name),
            may_persist=may_persist,
            persist_note=note,
        )
        if not may_persist:
            plan = _with_reason(plan, f"{plan.reason}; {note}")
        loaded = prefix
        if plan.path == ResumePath.FULL_HIT:
            assert reuse.pooled_prefix is not None and reuse.pooled_prefix.n_tokens == plan.resume_from
            loaded = reuse.pooled_prefix
        reused: dict[tuple[int, int], bytes] = {}
        reused_hashes: dict[tuple[int, int], bytes] = {}
        if plan.path in (ResumePath.FULL_HIT, ResumePath.GLOBAL_REPLAY):
            if loaded.payloads_read:
                reused = dict(zip(loaded.ranges, loaded.blobs, strict=True))
            reused_hashes = dict(zip(loaded.ranges, loaded.payload_hashes(), strict=True))
        return TurnFacts(
            **reg.facts,
            history=reg.history,
            history_ids=reg.history_ids,
            plan=plan,
            served=reg.served,
            new_tokens=reg.new_tokens,
            prefix=prefix,
            own_stored=min(reg.own_stored, loaded.n_tokens),
            sender_prefix=sender_prefix,
            sender=sender,
            full_hit_state=reuse.full_hit_state if plan.path == ResumePath.FULL_HIT else None,
            artifacts=artifacts,
            reused=reused,
            reused_hashes=reused_hashes,
            content_source=reuse.source_session if plan.path == ResumePath.FULL_HIT else None,
        )


class _Registered(NamedTuple):
    """A turn's checked registry facts (`TurnPreparation._registered`), in `prepare`'s order."""

    name: str
    served: ServedModel
    new_tokens: list[int]
    history: list[int]
    history_ids: bytes
    view: Any
    policy: EffectivePolicy
    own_stored: int
    foreign: set[str]
    last: str | None
    candidates: list[tuple[MapperArtifact, MapperInfo]]
    row_id: str
    facts: dict[str, Any]


class _SessionReads:
    """The turn's registry reads through the repositories, in one Session (any database)."""

    def __init__(self, s: Session, tenant_id: str, settings: Any) -> None:
        self._s, self._tenant, self._settings = s, tenant_id, settings
        self._history_blob: bytes | None = None  # the turn rows' blobs as `history` read them

    def facts(self, session_id: str, *, tenant_id: str) -> Any | None:
        return SessionRepository(self._s).facts(session_id, tenant_id=tenant_id)

    def history(self, session_id: str) -> list[int]:
        self._history_blob = SessionRepository(self._s).history_blob(session_id)
        return blob_to_tokens(self._history_blob)

    def history_ids(self, history: list[int]) -> bytes:
        # the turn rows' blobs as read (what `token_bytes(history)` gives, without encoding it again: about
        # 0.4 ms a turn at a 64K-token history), as `_SnapshotReads` gives them
        assert self._history_blob is not None and len(self._history_blob) == 4 * len(history)
        return self._history_blob

    def policy(self, tenant_id: str) -> EffectivePolicy:
        return PolicyRepository(self._s).effective(
            tenant_id,
            default_floor_s=self._settings.retention_floor_s,
            default_ceiling_s=self._settings.retention_ceiling_s,
        )

    def spans(self, session_id: str) -> list[Any]:
        return SegmentRepository(self._s).spans_of(session_id)

    def mappers(self, **filters: str) -> list[Any]:
        return MapperRepository(self._s).list(**filters)


class _SnapshotReads:
    """The same reads answered from a `TurnSnapshot` (read before, in one transaction)."""

    def __init__(self, snapshot: TurnSnapshot) -> None:
        self._snap = snapshot

    def facts(self, session_id: str, *, tenant_id: str) -> Any | None:
        return self._snap.row

    def history(self, session_id: str) -> list[int]:
        return self._snap.history

    def history_ids(self, history: list[int]) -> bytes:
        # the turn rows' blobs as read (`TurnSnapshot.history_ids`)
        assert history is self._snap.history and len(self._snap.history_ids) == 4 * len(history)
        return self._snap.history_ids

    def policy(self, tenant_id: str) -> EffectivePolicy:
        assert self._snap.policy is not None
        return self._snap.policy

    def spans(self, session_id: str) -> list[Any]:
        return self._snap.spans

    def mappers(self, *, receiver_model: str, sender_model: str | None = None) -> list[Any]:
        # the snapshot read every mapper to the turn's model when `_registered` reads any (`reads_mappers`)
        rows = self._snap.mappers
        assert rows is not None, "the snapshot holds no mapper rows: TurnReads and _registered disagree"
        return [m for m in rows if sender_model is None or m.sender_model == sender_model]


def _sender_inventory(prefix: StoredPrefix | None, *, new_session: bool) -> CacheInventory | None:
    if prefix is None:
        return None
    # a new session's sender prefix was stored by other sessions: all of it found by content
    return dataclasses.replace(prefix.inventory(), own_prefix=0) if new_session else prefix.inventory()


def _foreign_reason(served: ServedModel, foreign: set[str], prefix: StoredPrefix) -> str:
    """Why chunks the registry holds for this model do not count: the profile they were computed under
    (a cache that cannot be proven bit-identical to this node's computation is a miss)."""
    others = sorted(label for label in foreign if label != served.numerics.label)
    if others:
        named = "; ".join(label or "(unrecorded, older version)" for label in others)
        why = (
            f"stored KV of {served.name} was computed under numerics profile {named}, this node computes "
            f"under {served.numerics.label}: not bit-compatible, a miss"
        )
    else:
        why = f"stored KV of {served.name} was computed by other weights of it (another fingerprint)"
    return f"{why}; {prefix.miss_reason}" if prefix.miss_reason else why


def _with_reason(plan: Plan, reason: str) -> Plan:
    return dataclasses.replace(plan, reason=reason)
