"""The turn engine: plans a turn (`turn_facts.TurnPreparation`), reserves its row, runs the plan on the
model, streams tokens, and at turn end persists global KV chunks, the registry rows and the pool entry.

Implements the API's `TurnHandler` (plan first, tokens, stats last). Knows nothing of protobuf. A turn
that fails, misses its deadline or is aborted without keep_partial leaves the session at its last
completed turn: its row is removed, nothing is linked in the registry and the pool keeps the previous
entry. An abort with keep_partial during generation ends the turn as if generation had stopped there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import structlog
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from model import PassStats
from orchestrator.api import (
    CancelledError,
    DeadlineError,
    FinishReason,
    NotFoundError,
    PlanEvent,
    PreconditionError,
    ServiceContext,
    TokenChunkEvent,
    TurnEvent,
    TurnHandle,
    TurnInput,
    TurnStatsEvent,
)
from orchestrator.db import (
    SessionRepository,
    TurnRepository,
    TurnTimings,
    run_serializable,
    run_serializable_connection,
)
from orchestrator.db.models import (
    ResumePathName,
    SessionRow,
    SessionStatus,
    TurnRow,
    TurnStatus,
    tokens_to_blob,
)
from orchestrator.engine.decoded_states import DecodedStates
from orchestrator.engine.global_kv import chunk_ranges, persist_chunks
from orchestrator.engine.model_compute import ModelCompute, TorchCompute, TurnEndExport, export_turn_end
from orchestrator.engine.payload_digests import PayloadDigests
from orchestrator.engine.pool_entry import pack_pool_entry
from orchestrator.engine.sampler import Sampler
from orchestrator.engine.served_models import ModelRegistry, ServedModel
from orchestrator.engine.swap import KVMapperApplier, NoMappers
from orchestrator.engine.turn_facts import TurnFacts, TurnPreparation
from orchestrator.planner import CostTable, ResumePath, TokenCounts
from orchestrator.registry_writer import DriverFinish, FinishRequest, RegistryWriter, write_finish
from orchestrator.scheduler import (
    Continued,
    DecodeChain,
    PassWait,
    SerialScheduler,
    TurnScheduler,
    WorkOwner,
    await_pass,
    wait_inline,
)
from storage import ContentKey, GlobalKVStore, WindowPool, history_digest, token_bytes

__all__ = ["TurnEngine", "actual_counts"]

log = structlog.get_logger(__name__)

_COUNT_FIELDS = dataclasses.fields(TokenCounts)


def actual_counts(
    path: ResumePath, *, loaded: int, history_len: int, prompt_len: int, passes: Sequence[PassStats]
) -> TokenCounts:
    """Token counts by kind of what the prefill passes actually ran (ARCHITECTURE §1).

    Args:
        loaded: tokens of the state before the prompt passes (stored or mapped global KV).
        history_len: tokens before this turn's new ones (decoder rows below it are replayed history).
        passes: the prefill passes' stats, in order.
    """
    first = passes[0]
    decoder_history = sum(max(0, min(p.end, history_len) - p.decoder_from) for p in passes)
    stored = {"mapped": loaded} if path == ResumePath.MODEL_SWAP else {"cached": loaded}
    return TokenCounts(
        **stored,
        replayed_encoder=loaded - first.start,
        replayed_decoder=decoder_history,
        prefilled=prompt_len - loaded,
    )


def _turn_row(f: TurnFacts) -> dict[str, Any]:
    """The columns of a turn row that its plan decides (the same for a reservation and a finished row)."""
    plan = f.plan
    return dict(
        session_id=f.session_id,
        model=plan.model,
        input_tokens=tokens_to_blob(f.new_tokens),
        path=ResumePathName(str(plan.path)),
        reason=plan.reason,
        # the turn row has one column per count kind, named as TokenCounts' fields (flat ints: `asdict`
        # without its deep copy)
        **{f.name: getattr(plan.counts, f.name) for f in _COUNT_FIELDS},
    )


def _stored_tokens(outcome: Any, stored_before: int) -> int:
    """Tokens of the history covered by stored chunks after the turn (what was there before when the
    turn stored nothing)."""
    if outcome is None or not outcome.persisted or not outcome.segments:
        return stored_before
    return max(seg.end_pos for seg in outcome.segments)


def _decoded_ahead(
    got: Continued, token: int, stops: set[int], generated: int, max_new_tokens: int, handle: TurnHandle
) -> Continued | None:
    """The chain's next pass when it has already ended with a sampled token that the turn streams after
    `token` (the `generated`-th), else None: the turn then stops after `token` (a stop token, the length
    limit, a cancel), or waits for that pass (not done, failed, or halted without a token)."""
    if token in stops or generated >= max_new_tokens or handle.cancelled:
        return None
    nxt = got.next
    if nxt is None or not nxt.done() or nxt.cancelled() or nxt.exception() is not None:
        return None
    ahead = nxt.result()
    if not isinstance(ahead, Continued) or ahead.token is None:
        return None
    return ahead


class TurnEngine:
    """Runs turns for the Sessions servicer (many sessions at once; one turn per session is enforced by
    the servicer's RunningTurns and by the registry's unique turn index).

    Args:
        ctx: the service context (registry sessions, settings, metrics).
        registry: the served models.
        store, pool: this node's global KV store and window pool.
        costs: the planner's per-token costs.
        mappers: applies mapper artifacts on a model switch (NoMappers: every switch is a cold prefill).
        clock: wall seconds for registry expiry stamps.
        prefill_chunk_tokens: longest prompt slice run in one forward pass (bounds activation memory);
            the scheduler's step budget bounds it further.
        scheduler: how this turn's forward passes share the model with other sessions' (default: the
            serial scheduler over `compute`).
        compute: the model operations (default `TorchCompute`: the real model).
        decoded: decoded global KV kept beside pool entries (default: one of the settings'
            `decoded_state_budget_bytes`, owned by `pool`; `decoded_states.py`).
    """

    def __init__(
        self,
        *,
        ctx: ServiceContext,
        registry: ModelRegistry,
        store: GlobalKVStore,
        pool: WindowPool,
        costs: CostTable | None = None,
        mappers: KVMapperApplier | None = None,
        clock: Callable[[], float] = time.time,
        prefill_chunk_tokens: int = 1024,
        compute: ModelCompute | None = None,
        scheduler: TurnScheduler | None = None,
        decoded: DecodedStates | None = None,
        registry_writer: RegistryWriter | None = None,
    ) -> None:
        if prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be positive")
        self._ctx = ctx
        self.registry = registry
        self.store = store
        self.pool = pool
        self.costs = costs if costs is not None else CostTable()
        self.mappers = mappers if mappers is not None else NoMappers()
        self._clock = clock
        self._chunk = prefill_chunk_tokens
        self.compute = compute if compute is not None else TorchCompute()
        self.scheduler = scheduler if scheduler is not None else SerialScheduler(self.compute)
        if self.scheduler.chunk_tokens is not None:
            self._chunk = min(self._chunk, self.scheduler.chunk_tokens)
        self.decoded = (
            decoded
            if decoded is not None
            else DecodedStates(ctx.settings.decoded_state_budget_bytes, pool=pool, metrics=ctx.metrics)
        )
        dialect = ctx.engine.dialect
        self._driver_finish = DriverFinish(dialect) if dialect.name == "sqlite" else None
        # SQLite's finish (driver statements, no reservation) runs on a Connection of `ctx.writer` instead
        # of an ORM Session; False runs it through `ctx.serializable`, its twin (tests compare the two).
        self.finish_on_connection = True
        # SQLite: the finishes run in this registry writer process (None: in the turn's own thread) while at
        # least `writer_from_running` turns run on this node. A lone turn's finish runs in its own thread:
        # nothing then contends for this process's GIL, and the hop would add about 0.4 ms (session 24,
        # one no-op session: 1.3-1.9 ms a finish through the process against 0.9-1.1 ms here).
        self.registry_writer = registry_writer if self._driver_finish is not None else None
        self.writer_from_running = 2
        self._prep = TurnPreparation(
            ctx=ctx,
            registry=registry,
            store=store,
            pool=pool,
            costs=self.costs,
            mappers=self.mappers,
            compute=self.compute,
            decoded=self.decoded,
            digests=PayloadDigests(),
        )

    @staticmethod
    def _check(turn: TurnInput, handle: TurnHandle, *, finishing_partial: bool = False) -> None:
        """Raise when the turn must stop: cancelled (unless it is already finishing a kept partial turn)
        or past its deadline."""
        if handle.cancelled and not finishing_partial:
            raise CancelledError(f"turn aborted: {handle.reason}")
        if turn.deadline_monotonic is not None and time.monotonic() > turn.deadline_monotonic:
            raise DeadlineError(f"turn of session {turn.session_id} passed its deadline")

    def _reserve(self, f: TurnFacts) -> tuple[int | None, int]:
        """Reserve the turn where another replica could race for the session; returns (row id or None,
        turn index).

        On PostgreSQL (shared by replicas) this inserts the RUNNING turn row with its plan, so that a
        twin turn on another node is refused before it runs. On SQLite (one node) this process's
        RunningTurns already refuses a twin, so nothing is written here: the turn's one transaction
        at its end (`_finish`) inserts the finished row after checking the session did not move.
        """
        if self._ctx.engine.dialect.name == "sqlite":
            return None, f.turn_count
        sessions, turns = SessionRow.__table__, TurnRow.__table__

        def work(s):
            row = s.execute(
                select(sessions.c.status, sessions.c.turn_count)
                .where(sessions.c.id == f.session_id, sessions.c.tenant_id == f.tenant_id)
                .with_for_update()
            ).one_or_none()
            if row is None:
                raise NotFoundError(f"session {f.session_id} not found")
            if row.status != SessionStatus.OPEN:
                raise PreconditionError(f"session {f.session_id} is closed", reason="SESSION_CLOSED")
            if row.turn_count != f.turn_count:
                raise PreconditionError(f"session {f.session_id} advanced to turn {row.turn_count} meanwhile")
            running = s.scalar(
                select(turns.c.id)
                .where(turns.c.session_id == f.session_id, turns.c.status == TurnStatus.RUNNING)
                .limit(1)
            )
            if running is not None:
                # Another replica runs a turn on this session (this process's RunningTurns refused its
                # own twin already); a crashed node's leftovers are removed when that node starts.
                raise PreconditionError(
                    f"session {f.session_id} has a turn running on another node",
                    reason="TURN_RUNNING",
                    retry_after_s=1.0,
                )
            if not f.new_tokens:
                raise ValueError(f"turn of session {f.session_id} appends no tokens")
            try:
                turn_id = s.scalar(
                    insert(turns)
                    .values(index=row.turn_count, status=TurnStatus.RUNNING, **_turn_row(f))
                    .returning(turns.c.id)
                )
            except IntegrityError as exc:
                raise PreconditionError(f"session {f.session_id} started another turn meanwhile") from exc
            return turn_id, row.turn_count

        return run_serializable(self._ctx.serializable, work)

    def _abandon(self, f: TurnFacts, turn_id: int | None, status: TurnStatus) -> None:
        if turn_id is None:
            # Nothing was reserved (SQLite): the turn leaves no row behind.
            return

        def work(s):
            t = s.get(TurnRow, turn_id)
            row = SessionRepository(s).get(f.session_id, tenant_id=f.tenant_id)
            if t is not None and row is not None and t.status == TurnStatus.RUNNING:
                TurnRepository(s).finish(t, row, output_tokens=[], timings=TurnTimings(), status=status)

        try:
            run_serializable(self._ctx.serializable, work)
        except Exception as exc:  # noqa: BLE001 - the turn's own error is the one to report
            log.warning("turn_row_cleanup_failed", session_id=f.session_id, error=str(exc))

    def _start_state(self, f: TurnFacts) -> Any | None:
        plan = f.plan
        if plan.path == ResumePath.FULL_HIT:
            assert f.full_hit_state is not None and f.full_hit_state.n_tokens == plan.resume_from
            return f.full_hit_state
        if plan.path == ResumePath.GLOBAL_REPLAY:
            assert f.prefix.state is not None and f.prefix.n_tokens == plan.resume_from
            return f.prefix.state
        if plan.path == ResumePath.MODEL_SWAP:
            assert f.sender is not None and f.sender_prefix is not None and plan.mapper_id is not None
            return self.mappers.apply(
                f.artifacts[plan.mapper_id],
                sender=f.sender,
                receiver=f.served,
                # the prompt: a new session maps a prefix of its first prompt found by content
                history=f.history + f.new_tokens,
                sender_blobs=f.sender_prefix.blobs,
                n_tokens=plan.resume_from,
            )
        return None

    def _prefill(
        self,
        served: ServedModel,
        prompt: list[int],
        state: Any | None,
        turn: TurnInput,
        handle: TurnHandle,
        owner: WorkOwner,
        chain: DecodeChain,
    ) -> Generator[PassWait, None, tuple[Continued, list[PassStats]]]:
        """The prompt's chunks, one pass each; the last one starts the turn's decode chain (its result
        holds the first token, and that token's decode already queued where the scheduler queues)."""
        start = state.n_tokens if state is not None else 0
        passes: list[PassStats] = []
        pos = start
        while True:
            self._check(turn, handle)
            end = min(pos + self._chunk, len(prompt))
            chunk = prompt[pos:end]
            last = end >= len(prompt)
            # another chunk follows at once; after the last one the chain queues the first decode
            got = yield from await_pass(
                self.scheduler.submit_prefill(served, chunk, state, prompt_end=len(prompt), owner=owner,
                                              follow_up=not last, chain=chain if last else None)  # fmt: skip
            )
            out = got.output if last else got
            state = out.state
            passes.append(out.stats)
            if last:
                return got, passes
            pos = end

    def _decode_of(self, served: ServedModel, got: Continued, owner: WorkOwner) -> Future:
        """The decode of `got`'s token: the one the scheduler queued, else submitted now (continuing the
        chain when the turn goes on after it)."""
        if got.next is not None:
            return got.next
        assert got.token is not None
        return self.scheduler.submit_decode(served, got.token, got.output.state, owner=owner, chain=got.then)

    def _drain(
        self, served: ServedModel, got: Continued, output: list[int], owner: WorkOwner
    ) -> Generator[TurnEvent | PassWait, None, Any]:
        """After the turn halted its chain early (an Abort that keeps the partial turn): the state that
        covers every token the turn keeps. Passes the chain queued before the halt still end; a token
        sampled before it is kept (and streamed), and the last kept token is decoded."""
        while True:
            if got.token is None:  # halted before sampling: this pass's state covers the output
                return got.output.state
            if got.next is None:
                plain = self.scheduler.submit_decode(served, got.token, got.output.state, owner=owner)
                return (yield from await_pass(plain)).state
            after = yield from await_pass(got.next)
            if not isinstance(after, Continued):  # the turn's last decode: nothing sampled after it
                return after.state
            got = after
            if got.token is not None:
                output.append(got.token)
                yield TokenChunkEvent(ids=(got.token,), text=served.codec.decode([got.token]))

    def run_turn(self, turn: TurnInput, handle: TurnHandle) -> Iterator[TurnEvent]:
        """The turn's events, this thread waiting out each forward pass (`turn_steps`, driven inline)."""
        return wait_inline(self.turn_steps(turn, handle))

    def turn_steps(self, turn: TurnInput, handle: TurnHandle) -> Iterator[TurnEvent | PassWait]:
        """The turn as steps: its events, and a PassWait wherever it waits for a forward pass. The driver
        resumes the steps once that pass is done (blocking a thread, or awaiting the future on an event
        loop); the steps hold no lock and no connection across a PassWait."""
        started = time.perf_counter()
        self._check(turn, handle)
        f = self._prep.prepare(turn)
        owner = WorkOwner(tenant_id=f.tenant_id, session_id=f.session_id)
        # Admission before the turn row exists: a refused turn leaves nothing behind.
        with self.scheduler.admit(f.served.name, owner):
            yield from self._run_admitted(turn, handle, f, owner, started)

    def _run_admitted(
        self, turn: TurnInput, handle: TurnHandle, f: TurnFacts, owner: WorkOwner, started: float
    ) -> Iterator[TurnEvent | PassWait]:
        self._check(turn, handle)
        turn_id, index = self._reserve(f)
        status = TurnStatus.FAILED
        output: list[int] = []
        ttft = 0.0
        try:
            yield PlanEvent(plan=f.plan, turn_index=index)
            plan, served = f.plan, f.served
            state = self._start_state(f)
            loaded = state.n_tokens if state is not None else 0
            prompt = f.history + f.new_tokens
            stops = set(turn.generation.stop_token_ids)
            # The scheduler samples each token as its pass ends and queues the next decode (chains.py);
            # this thread streams them, checks cancellation between them, and halts the chain early.
            gen = turn.generation
            chain = DecodeChain(
                Sampler(gen), stops=stops, max_new_tokens=gen.max_new_tokens, persist=plan.persist
            )
            try:
                got, passes = yield from self._prefill(served, prompt, state, turn, handle, owner, chain)
                counts = actual_counts(plan.path, loaded=loaded, history_len=len(f.history),
                                       prompt_len=len(prompt), passes=passes)  # fmt: skip
                if counts != plan.counts:
                    log.warning("turn_counts_differ_from_plan", planned=str(plan.counts), actual=str(counts))
                ttft = time.perf_counter() - started
                finish = FinishReason.LENGTH
                decode_started = time.perf_counter()
                while True:
                    assert got.token is not None  # only a halt leaves a pass without a token
                    token = got.token
                    output.append(token)
                    chunk = [token]
                    # Tokens whose passes have already ended go out with this one, in one message: under
                    # load the chain runs ahead of this thread, and each streamed message costs the
                    # server and the client a send, a receive and their thread hand-offs. No token
                    # waits for another (only passes already done are read).
                    while (ahead := _decoded_ahead(got, token, stops, len(output), gen.max_new_tokens,
                                                   handle)) is not None:  # fmt: skip
                        got, token = ahead, ahead.token
                        output.append(token)
                        chunk.append(token)
                    yield TokenChunkEvent(ids=tuple(chunk), text=served.codec.decode(chunk))
                    if token in stops:
                        finish = FinishReason.STOP
                        break
                    if len(output) >= turn.generation.max_new_tokens:
                        break
                    if handle.cancelled and handle.keep_partial:
                        finish = FinishReason.ABORTED
                        break
                    self._check(turn, handle)
                    got = yield from await_pass(self._decode_of(served, got, owner))
                decode_s = time.perf_counter() - decode_started
                full = prompt + output
                persisted = False
                outcome = None
                partial = finish == FinishReason.ABORTED
                if partial:
                    chain.halt()
                self._check(turn, handle, finishing_partial=partial)
                if plan.persist:
                    # The last sampled token has not run through the model yet: its decode (queued by the
                    # chain, or submitted now) makes the stored global KV cover the whole history the
                    # next turn resumes.
                    if partial:
                        state = yield from self._drain(served, got, output, owner)
                        full = prompt + output
                    else:
                        state = (yield from await_pass(self._decode_of(served, got, owner))).state
                    self._check(turn, handle, finishing_partial=partial)
            finally:
                # a turn that stops early (an error, a cancellation, a client gone) queues nothing more
                chain.halt()
            turn_end: TurnEndExport | None = None
            if plan.persist:
                # the history's ids as the store and the digests take them, encoded once for both (the
                # turn rows' ids as read, then only this turn's)
                full_ids = f.history_ids + token_bytes(full[len(f.history) :])
                already_stored = f.own_stored if plan.path != ResumePath.MODEL_SWAP else 0
                # Everything the turn end takes from the state in one call (a model process's one round
                # trip): the chunks the put writes that the state was not loaded from, and the windows
                # and kept decoded KV that the pool put after the commit needs.
                ranges = chunk_ranges(len(full), self.store.config.chunk_tokens, from_pos=already_stored)
                turn_end = export_turn_end(
                    self.compute,
                    served,
                    state,
                    [r for r in ranges if r not in f.reused],
                    keep=self.decoded.enabled,
                )
                outcome = persist_chunks(
                    self.store,
                    tenant=f.tenant_id,
                    session_id=f.session_id,
                    served=served,
                    history=full,
                    state=state,
                    already_stored=already_stored,
                    retention_s=f.retention_s,
                    node=self._ctx.node,
                    clock=self._clock,
                    compute=self.compute,
                    known=f.reused,
                    known_hashes=f.reused_hashes,
                    digests=self._prep.digests,
                    history_ids=full_ids,
                    exported=turn_end.global_blobs,
                )
                persisted = outcome.persisted
            try:
                self._check(turn, handle, finishing_partial=partial)
            except BaseException:
                # The turn stops before its transaction: the store's records of the write go to the
                # store's own consumer instead of this turn's transaction.
                if outcome is not None:
                    self.store.release_audit(list(outcome.audit))
                raise
            total = time.perf_counter() - started
            rate = (len(output) - 1) / decode_s if len(output) > 1 and decode_s > 0 else 0.0
            self._finish(f, turn_id, output, persisted, outcome, ttft=ttft, rate=rate, total=total)
            status = TurnStatus.DONE
            if persisted:
                assert outcome is not None and turn_end is not None
                self._pool_turn_end(f, served, full, outcome.chunks, full_ids, turn_end)
            yield TurnStatsEvent(
                turn_index=index,
                ttft_s=ttft,
                decode_tokens_per_s=rate,
                counts=counts,
                generated_tokens=len(output),
                finish_reason=finish,
                total_s=total,
                persisted=persisted,
                stored_tokens=_stored_tokens(outcome, f.own_stored),
            )
        except CancelledError:
            if status != TurnStatus.DONE:
                self._abandon(f, turn_id, TurnStatus.ABORTED)
            # The plan went out: the stream ends with the turn's record, saying nothing of it was kept.
            yield TurnStatsEvent(
                turn_index=index,
                ttft_s=ttft if output else 0.0,
                decode_tokens_per_s=0.0,
                counts=f.plan.counts,
                generated_tokens=len(output),
                finish_reason=FinishReason.ABORTED,
                total_s=time.perf_counter() - started,
                persisted=False,
                stored_tokens=f.own_stored,
                kept=False,
            )
        except GeneratorExit:
            # The client went away: nobody reads a final event.
            if status != TurnStatus.DONE:
                self._abandon(f, turn_id, TurnStatus.ABORTED)
            raise
        except BaseException:
            if status != TurnStatus.DONE:
                self._abandon(f, turn_id, TurnStatus.FAILED)
            raise

    def _pool_turn_end(
        self,
        f: TurnFacts,
        served: ServedModel,
        full: list[int],
        chunks: bytes,
        full_ids: bytes,
        turn_end: TurnEndExport,
    ) -> None:
        """Pool the committed turn end's windows (and keep its decoded global KV beside them), so that
        the next turn of the session is a full hit. `full_ids`: `token_bytes(full)`; `turn_end`: what
        the turn end exported before its put (the windows and the kept KV among it), so that nothing
        here asks the compute (a model process lost now cannot fail a committed turn)."""
        windows, kept = turn_end.windows, turn_end.kept
        # the envelope and the content index name the same digest: hashed once, from the encoded ids
        digest = history_digest(full_ids)
        entry = pack_pool_entry(
            fingerprint=served.fingerprint, history=full, windows=windows, chunks=chunks, digest=digest
        )
        # Indexed by content: a later prompt of the tenant that starts with this history (another
        # session's too: a stateless client resending the conversation) continues from here.
        content = ContentKey(namespace=served.fingerprint_hex, n_tokens=len(full), digest=digest)
        # Kept beside the pool entry it belongs to (before its put, which drops the previous one).
        self.decoded.put(
            f.tenant_id,
            f.session_id,
            kept=kept,
            fingerprint=served.fingerprint,
            chunks=chunks,
            pool_value=entry,
        )
        if not self.pool.put(f.tenant_id, f.session_id, entry, content=content).stored:
            self.decoded.discard(f.tenant_id, f.session_id)

    def _finish(
        self, f: TurnFacts, turn_id: int | None, output: list[int], persisted: bool, outcome, **t: float
    ) -> None:
        """The turn's one registry transaction (orchestrator/registry_writer/finish.py): the finished
        turn row (inserted, or the reserved row closed), the session's new length and model, the segment
        links of what the store holds durably, and the store's audit records of this turn's write,
        mirrored into the tenant's chain. On SQLite it runs in the registry writer process when there is
        one, else on a Connection of `ctx.writer` (driver statements, no ORM Session). The audit records
        are acknowledged to the store after the commit, or handed back to it when the transaction fails.

        Raises:
            PreconditionError: the session was deleted, closed or advanced during the turn.
            RegistryWriterError: the registry writer process died.
        """
        plan = f.plan
        claimed = list(outcome.audit) if outcome is not None else []
        values = dict(
            status=TurnStatus.DONE,
            output_tokens=tokens_to_blob(output),
            ttft_s=t["ttft"],
            decode_tokens_per_s=t["rate"],
            total_s=t["total"],
            persisted=persisted,
        )
        # Parameters built before the transaction: every other turn waits while it holds the write lock.
        advance = {
            "sid": f.session_id,
            "tid": f.tenant_id,
            "next": f.turn_count + 1,
            "grown": len(f.new_tokens) + len(output),
            "new_model": plan.model,
        }
        new_turn = None
        if turn_id is None:
            advance.update(open=SessionStatus.OPEN, at=f.turn_count)
            new_turn = {"index": f.turn_count, **_turn_row(f), **values}
        req = FinishRequest(
            session_id=f.session_id,
            tenant_id=f.tenant_id,
            advance=advance,
            new_turn=new_turn,
            turn_id=turn_id,
            done=values,
            segments=list(outcome.segments) if outcome is not None and outcome.persisted else None,
            fingerprint=f.served.fingerprint_hex,
            claimed=claimed,
            node=self._ctx.node,
        )
        driver = self._driver_finish if turn_id is None else None
        audit = self._ctx.audit
        try:
            # One transaction per finish. A SQLite group commit (savepoint per finish, one COMMIT; commit
            # 1c82e3a, then removed) cut commits per turn to 0.23 at 64 sessions but
            # gained no turns/s there and lost about half at 8 sessions (wake-all suspected).
            if driver is not None and self.finish_on_connection:
                writer = self.registry_writer
                # the process starts at the node's first concurrent turns (a node that never runs two at
                # once never starts it); until it is up, their finishes run inline too
                if (
                    writer is not None
                    and self._ctx.running.count() >= self.writer_from_running
                    and writer.available()
                ):
                    writer.finish(req)
                else:
                    # Every statement is Core or driver SQL: the same transaction without an ORM Session
                    run_serializable_connection(
                        self._ctx.writer, lambda conn: write_finish(conn, conn, req, audit, driver)
                    )
            else:
                run_serializable(
                    self._ctx.serializable, lambda s: write_finish(s.connection(), s, req, audit, driver)
                )
        except BaseException:
            self.store.release_audit(claimed)
            raise
        self.store.ack_audit(claimed)
