"""A turn's facts before it runs: the session, history and policy from the registry, the longest usable
stored prefix of the receiver (and of the sender on a model switch), the pool entry, the usable mappers,
and the plan `plan_turn` chooses over them.

Knows nothing of executing a plan (`turn_engine.py`). Store reads happen outside any SQL transaction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model import CacheFormatError
from orchestrator.api import (
    InvalidRequestError,
    NotFoundError,
    PreconditionError,
    ServiceContext,
    TurnInput,
)
from orchestrator.db import (
    MapperRepository,
    PolicyRepository,
    SegmentRepository,
    SessionRepository,
    session_view,
)
from orchestrator.db.models import SessionStatus
from orchestrator.engine.global_kv import StoredPrefix, read_prefix
from orchestrator.engine.model_catalog import served_or_not_found
from orchestrator.engine.model_compute import ModelCompute
from orchestrator.engine.pool_entry import unpack_pool_entry
from orchestrator.engine.served_models import ModelRegistry, ServedModel
from orchestrator.engine.swap import KVMapperApplier, MapperArtifact
from orchestrator.planner import CostTable, MapperInfo, Plan, PoolState, plan_turn
from storage import GlobalKVStore, PoolMiss, WindowPool

__all__ = ["TurnFacts", "TurnPreparation"]


@dataclass(frozen=True, kw_only=True)
class TurnFacts:
    """A turn's facts before it runs: the session as read (plain values; the ORM row stays inside its
    session), the stored prefixes and pool state it may resume from, and the plan chosen over them.

    Attributes:
        own_stored: this session's own contiguous stored prefix of the receiver (full chunks below it
            need not be written again).
        full_hit_state: the receiver state with the pool windows imported (None unless they continue the
            whole stored history).
        artifacts: mapper artifacts the plan may name, by mapper id.
    """

    session_id: str
    tenant_id: str
    turn_count: int
    retention_s: float
    history: list[int]
    plan: Plan
    served: ServedModel
    new_tokens: list[int]
    prefix: StoredPrefix
    own_stored: int
    sender_prefix: StoredPrefix | None
    sender: ServedModel | None
    full_hit_state: Any | None
    artifacts: dict[str, MapperArtifact]


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
    ) -> None:
        self._ctx = ctx
        self.registry = registry
        self.store = store
        self.pool = pool
        self.costs = costs
        self.mappers = mappers
        self.compute = compute

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
        bad = [t for t in tokens if not 0 <= t < served.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary of {served.name} (size {served.vocab_size})",
                reason="TOKEN_OUT_OF_VOCABULARY",
                field="tokens",
            )
        return tokens

    def _pool_state(
        self,
        turn: TurnInput,
        served: ServedModel,
        prefix: StoredPrefix,
        history: list[int],
        last_model: str | None,
    ) -> tuple[PoolState, Any | None]:
        """The pool entry as the planner sees it, and a full-hit state when the entry continues the
        whole stored history and imports cleanly (validated before planning, so a plan never promises
        windows that are not there)."""
        got = self.pool.get(turn.tenant_id, turn.session_id)
        if isinstance(got, PoolMiss):
            return PoolState.absent(), None
        entry = unpack_pool_entry(got)
        if entry is None:
            return PoolState.absent(), None
        if entry.fingerprint != served.fingerprint:
            # Written by another model (the previous one on a switch) or by older weights of this one.
            other = last_model if last_model not in (None, served.name) else f"{served.name} (other weights)"
            return PoolState(model=other, windows_end=entry.n_tokens), None
        if entry.continues(served.fingerprint, history) is not None:
            if entry.n_tokens == len(history):
                return PoolState.absent(), None
            return PoolState(model=served.name, windows_end=entry.n_tokens), None
        if prefix.state is None or prefix.n_tokens != len(history):
            return PoolState(model=served.name, windows_end=entry.n_tokens), None
        trial = prefix.state.clone()
        try:
            self.compute.import_windows(served, trial, entry.windows)
        except CacheFormatError:
            return PoolState.absent(), None
        return PoolState(model=served.name, windows_end=entry.n_tokens), trial

    def prepare(self, turn: TurnInput) -> TurnFacts:
        """Read the session, its stored KV and pool entry, and plan the turn.

        Raises:
            NotFoundError: unknown session or model; PreconditionError: closed or inconsistent session;
            InvalidRequestError: token ids outside the vocabulary or text that encodes to nothing.
        """
        ctx = self._ctx
        settings = ctx.settings
        with ctx.sessions() as s:
            row = SessionRepository(s).get(turn.session_id, tenant_id=turn.tenant_id)
            if row is None:
                raise NotFoundError(f"session {turn.session_id} not found")
            if row.status != SessionStatus.OPEN:
                raise PreconditionError(f"session {row.id} is closed", reason="SESSION_CLOSED")
            name = turn.model or row.model
            served = self._served(name)
            new_tokens = self._new_tokens(turn, served)
            history = SessionRepository(s).history(row.id)
            if len(history) != row.history_tokens:
                raise PreconditionError(
                    f"session {row.id}: its turns hold {len(history)} history tokens, "
                    f"the row says {row.history_tokens}"
                )
            if history and max(history) >= served.vocab_size:
                # a switch to a model with a smaller vocabulary cannot read this history
                raise InvalidRequestError(
                    f"session {row.id}'s history holds token id {max(history)}, outside the vocabulary of "
                    f"{served.name} (size {served.vocab_size})",
                    reason="TOKEN_OUT_OF_VOCABULARY",
                    field="model",
                )
            view = session_view(row, new_tokens=len(new_tokens))
            policy = PolicyRepository(s).effective(
                row.tenant_id,
                default_floor_s=settings.retention_floor_s,
                default_ceiling_s=settings.retention_ceiling_s,
            )
            own_stored = 0
            # Chunks of this model computed under another fingerprint: other weights, or another
            # numerics profile (another node's CPU path or kernels); either way a miss here.
            foreign: set[str] = set()
            for seg in SegmentRepository(s).for_session(row.id):
                if seg.fingerprint == served.fingerprint_hex and seg.start_pos == own_stored:
                    own_stored = seg.end_pos
                elif seg.model == name and seg.fingerprint != served.fingerprint_hex:
                    foreign.add(seg.numerics)
            last = view.last_model
            candidates: list[tuple[MapperArtifact, MapperInfo]] = []
            if last is not None and last != name:
                for m in MapperRepository(s).list(sender_model=last, receiver_model=name):
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
                    )
                    candidates.append((art, info))
            facts = dict(
                session_id=row.id,
                tenant_id=row.tenant_id,
                turn_count=row.turn_count,
                retention_s=min(row.retention_s, policy.ceiling_s),
            )
        # Store reads happen outside any SQL transaction: a store call may deliver audit records to the
        # SQL sink, so holding a SQLite write lock across it could wait on itself.
        prefix = read_prefix(
            self.store,
            ctx.sessions,
            tenant=turn.tenant_id,
            served=served,
            history=history,
            compute=self.compute,
        )
        if foreign and prefix.n_tokens < len(history):
            prefix = dataclasses.replace(prefix, miss_reason=_foreign_reason(served, foreign, prefix))
        sender = sender_prefix = None
        infos: list[MapperInfo] = []
        artifacts: dict[str, MapperArtifact] = {}
        if last is not None and last != name:
            sender = self.registry.get(last)
            if sender is not None:
                sender_prefix = read_prefix(
                    self.store,
                    ctx.sessions,
                    tenant=turn.tenant_id,
                    served=sender,
                    history=history,
                    compute=self.compute,
                )
                for art, info in candidates:
                    # A mapper that cannot run on this node is as good as none: plan without it.
                    if self.mappers.usable(art, sender, served):
                        artifacts[art.mapper_id] = art
                        infos.append(info)
        if history:
            # a new session has nothing to look up; the metric counts lookups (hit, partial, miss, corrupt)
            ctx.metrics.cache_lookups.labels(result=prefix.lookup_result).inc()
        region = self.store.config.region
        may_persist = policy.may_store_in(region)
        note = (
            ""
            if may_persist
            else f"residency: tenant {turn.tenant_id} allows regions {list(policy.allowed_regions)}, "
            f"this node is in {region!r}; served without persisting"
        )
        pool, full_state = self._pool_state(turn, served, prefix, history, view.last_model)
        plan = plan_turn(
            view,
            model=name,
            geometry=served.geometry,
            cache=prefix.inventory(),
            sender_cache=sender_prefix.inventory() if sender_prefix is not None else None,
            pool=pool,
            mappers=infos,
            costs=self.costs.for_model(name),
            may_persist=may_persist,
            persist_note=note,
        )
        if not may_persist:
            plan = _with_reason(plan, f"{plan.reason}; {note}")
        return TurnFacts(
            **facts,
            history=history,
            plan=plan,
            served=served,
            new_tokens=new_tokens,
            prefix=prefix,
            own_stored=min(own_stored, prefix.n_tokens),
            sender_prefix=sender_prefix,
            sender=sender,
            full_hit_state=full_state,
            artifacts=artifacts,
        )


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
