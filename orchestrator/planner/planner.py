"""The planner: a pure function from a turn's facts to the cheapest valid resume path, with its reason.

Knows nothing of SQL, storage, gRPC or the model; see `inputs.py` for what callers must verify first.
Validity rules enforced here (ARCHITECTURE §1): a pool entry counts only for the same model at exactly
the end of the history, or (found by content) at exactly the end of a verified stored prefix of the
prompt; a stored prefix counts only for the model that wrote it and always leaves the prompt's last token
to compute; a model switch maps KV only through a registered mapper that passed its gate; the encoder
replay starts at a compression-group boundary at most W + group - 1 tokens before the resume point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.planner.costs import Costs, estimate_seconds
from orchestrator.planner.inputs import (
    CacheInventory,
    MapperInfo,
    ModelGeometry,
    PooledPrefix,
    PoolState,
    SessionView,
)
from orchestrator.planner.plan import Plan, PlanReason, ResumePath, TokenCounts

__all__ = ["plan_turn", "no_mapper_reason"]

# On an exact cost tie prefer the exact paths, then the approximate ones (ARCHITECTURE §1).
_TIE_ORDER = {
    ResumePath.FULL_HIT: 0,
    ResumePath.COLD_PREFILL: 1,
    ResumePath.GLOBAL_REPLAY: 2,
    ResumePath.MODEL_SWAP: 3,
}


def no_mapper_reason(sender: str, receiver: str) -> str:
    return f"no validated mapper for {sender} -> {receiver}"


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    path: ResumePath
    counts: TokenCounts
    resume_from: int
    replay_from: int
    reason: str
    reason_code: PlanReason
    source_model: str | None = None
    mapper_id: str | None = None


def _decoder_replay(session: SessionView, geometry: ModelGeometry) -> int:
    # The decoder runs over the last W prompt tokens; those before the new tokens are history re-run.
    return max(0, min(geometry.window, session.prompt_len) - session.new_tokens)


def _replay_start(prefix: int, geometry: ModelGeometry) -> int:
    start = max(0, prefix - geometry.window)
    return start - start % geometry.group


def _cold(session: SessionView, geometry: ModelGeometry, reason: str, code: PlanReason) -> _Candidate:
    counts = TokenCounts(prefilled=session.prompt_len, replayed_decoder=_decoder_replay(session, geometry))
    return _Candidate(
        path=ResumePath.COLD_PREFILL,
        counts=counts,
        resume_from=0,
        replay_from=0,
        reason=reason,
        reason_code=code,
    )


def _from_prefix(
    session: SessionView,
    geometry: ModelGeometry,
    prefix: int,
    *,
    path: ResumePath,
    reason: str,
    reason_code: PlanReason,
    source_model: str,
    mapper_id: str | None = None,
) -> _Candidate:
    start = _replay_start(prefix, geometry)
    stored = {"mapped": prefix} if path == ResumePath.MODEL_SWAP else {"cached": prefix}
    counts = TokenCounts(
        **stored,
        replayed_encoder=prefix - start,
        replayed_decoder=_decoder_replay(session, geometry),
        prefilled=session.prompt_len - prefix,
    )
    return _Candidate(
        path=path,
        counts=counts,
        resume_from=prefix,
        replay_from=start,
        reason=reason,
        reason_code=reason_code,
        source_model=source_model,
        mapper_id=mapper_id,
    )


def _checked_prefix(session: SessionView, cache: CacheInventory | None, model: str | None) -> int:
    if cache is None or model is None:
        return 0
    if cache.model != model:
        raise ValueError(f"cache inventory of model {cache.model!r} passed where {model!r} was expected")
    if cache.valid_prefix >= session.prompt_len:
        raise ValueError(
            f"stored prefix {cache.valid_prefix} is not shorter than session {session.session_id}'s prompt "
            f"of {session.prompt_len} tokens: the inventory is not of this prompt (its last token is always "
            "computed)"
        )
    return cache.valid_prefix


def _prefix_reason(prefix: int, session: SessionView, cache: CacheInventory) -> str:
    n = session.history_len
    if prefix == n:
        text = f"global KV of all {prefix} history tokens stored"
    elif prefix > n:
        text = f"global KV of {prefix} of {session.prompt_len} prompt tokens stored"
        if n:
            text += f" (the {n} history tokens and {prefix - n} new ones)"
    else:
        why = f" ({cache.miss_reason})" if cache.miss_reason else ""
        text = f"global KV of {prefix} of {n} history tokens stored{why}"
    if cache.by_content:
        assert cache.own_prefix is not None
        text += (
            f", {prefix - cache.own_prefix} of them found by content (stored by other sessions of the tenant)"
        )
    return text


def _pool_miss(pool: PoolState, session: SessionView, model: str, prefix: int) -> str:
    if pool.model is None:
        return "windows not in the pool"
    if pool.model != model:
        return f"pool windows belong to {pool.model}"
    if pool.windows_end != session.history_len:
        return f"pool windows end at {pool.windows_end}, history at {session.history_len}"
    # The windows continue the whole history, but the resume point is the end of the stored prefix.
    return f"pool windows end at {pool.windows_end}, past the stored prefix"


def _full_hit(
    session: SessionView, geometry: ModelGeometry, at: int, reason: str, code: PlanReason, model: str
) -> _Candidate:
    # Windows and encoder output rows continue exactly from `at`: no replay, everything after it encoded.
    counts = TokenCounts(
        cached=at, replayed_decoder=_decoder_replay(session, geometry), prefilled=session.prompt_len - at
    )
    return _Candidate(
        path=ResumePath.FULL_HIT,
        counts=counts,
        resume_from=at,
        replay_from=at,
        source_model=model,
        reason=reason,
        reason_code=code,
    )


def _full_hits(
    session: SessionView,
    model: str,
    geometry: ModelGeometry,
    prefix: int,
    stored: str,
    pool: PoolState,
    pooled: PooledPrefix | None,
) -> list[_Candidate]:
    """FULL_HIT candidates: this session's pool entry at the end of a wholly stored history, and the
    pooled prefix found by content (which may be the same entry, or another session's)."""
    out: list[_Candidate] = []
    n = session.history_len
    if n and prefix == n and pool.model == model and pool.windows_end == n:
        out.append(
            _full_hit(
                session, geometry, n, f"{stored}; windows in the pool", PlanReason.WINDOWS_IN_POOL, model
            )
        )
    if pooled is None or pooled.model != model or any(c.resume_from == pooled.n_tokens for c in out):
        return out
    at = pooled.n_tokens
    if at >= session.prompt_len:
        raise ValueError(
            f"pooled prefix of {at} tokens is not shorter than session {session.session_id}'s prompt of "
            f"{session.prompt_len} tokens"
        )
    if pooled.own and at == n:
        reason, code = (
            f"global KV of all {n} history tokens stored; windows in the pool",
            PlanReason.WINDOWS_IN_POOL,
        )
    else:
        who = "this session" if pooled.own else "another session of the tenant"
        reason = (
            f"global KV of {at} of {session.prompt_len} prompt tokens stored and the windows that continue "
            f"them pooled by {who}, found by content"
        )
        code = PlanReason.WINDOWS_BY_CONTENT
    out.append(_full_hit(session, geometry, at, reason, code, model))
    return out


def _same_model_candidates(
    session: SessionView,
    model: str,
    geometry: ModelGeometry,
    cache: CacheInventory | None,
    pool: PoolState,
    pooled: PooledPrefix | None = None,
) -> list[_Candidate]:
    prefix = _checked_prefix(session, cache, model)
    stored = _prefix_reason(prefix, session, cache) if cache is not None and prefix else ""
    hits = _full_hits(session, model, geometry, prefix, stored, pool, pooled)
    if prefix == 0 and not hits:
        if session.history_len == 0:
            return [_cold(session, geometry, "new session: no history to reuse", PlanReason.NEW_SESSION)]
        why = (cache.miss_reason if cache is not None and cache.miss_reason else None) or "nothing stored"
        return [_cold(session, geometry, f"nothing usable stored: {why}", PlanReason.NOTHING_USABLE_STORED)]
    reused = max([prefix, *(c.resume_from for c in hits)])
    cheaper = f"cold prefill is cheaper than reusing the {reused} stored tokens"
    out = [_cold(session, geometry, cheaper, PlanReason.COLD_CHEAPER), *hits]
    if prefix == 0:
        return out
    assert cache is not None
    if hits:
        window_why = "bounded replay instead of restoring the pool windows"
    else:
        window_why = f"{_pool_miss(pool, session, model, prefix)}, bounded replay"
    out.append(
        _from_prefix(
            session,
            geometry,
            prefix,
            path=ResumePath.GLOBAL_REPLAY,
            source_model=model,
            reason=f"{stored}; {window_why}",
            reason_code=PlanReason.PREFIX_BY_CONTENT if cache.by_content else PlanReason.WINDOWS_REBUILT,
        )
    )
    return out


def _best_mapper(mappers: Sequence[MapperInfo], sender: str, model: str) -> MapperInfo | None:
    """The validated mapper of sender -> model to use: the best score, then the lowest id (deterministic)."""
    valid = [m for m in mappers if m.passed_gate and m.sender_model == sender and m.receiver_model == model]
    return min(valid, key=lambda m: (-m.score, m.mapper_id), default=None)


def _swap(
    session: SessionView,
    geometry: ModelGeometry,
    model: str,
    sender_cache: CacheInventory,
    sender_prefix: int,
    mapper: MapperInfo,
    reason_code: PlanReason,
) -> _Candidate:
    """MODEL_SWAP of the sender's stored prefix through `mapper` (on a switch, or found by content)."""
    sender = sender_cache.model
    stored = _prefix_reason(sender_prefix, session, sender_cache)
    return _from_prefix(
        session,
        geometry,
        sender_prefix,
        path=ResumePath.MODEL_SWAP,
        source_model=sender,
        mapper_id=mapper.mapper_id,
        reason=(
            f"{sender} -> {model} via mapper {mapper.mapper_id}{_retention_text(mapper)}: "
            f"{stored} on {sender}"
        ),
        reason_code=reason_code,
    )


def _retention_text(mapper: MapperInfo) -> str:
    """" (task retention 0.97)" when the mapper's evaluation measured it, else nothing."""
    return f" (task retention {mapper.retention:.3f})" if mapper.retention is not None else ""


def _content_swap_candidates(
    session: SessionView,
    model: str,
    geometry: ModelGeometry,
    cache: CacheInventory | None,
    sender_cache: CacheInventory,
    pool: PoolState,
    pooled: PooledPrefix | None,
    mappers: Sequence[MapperInfo],
) -> list[_Candidate]:
    """A new session whose prompt another model of the tenant has stored (found by content): the model-swap
    rules apply as on a switch (a validated mapper of that model -> this one, else nothing of it is used),
    beside this model's own candidates (its cold prefill included: a new session has no last model)."""
    sender = sender_cache.model
    candidates = _same_model_candidates(session, model, geometry, cache, pool, pooled)
    mapper = _best_mapper(mappers, sender, model)
    sender_prefix = _checked_prefix(session, sender_cache, sender)
    if mapper is None or sender_prefix == 0:
        return candidates
    candidates.append(
        _swap(session, geometry, model, sender_cache, sender_prefix, mapper, PlanReason.MAPPED_BY_CONTENT)
    )
    cheaper = f"cold prefill on {model} is cheaper than mapping {sender_prefix} tokens from {sender}"
    return [
        _cold(session, geometry, cheaper, PlanReason.COLD_CHEAPER)
        if c.path == ResumePath.COLD_PREFILL and c.reason_code == PlanReason.NEW_SESSION
        else c
        for c in candidates
    ]


def plan_turn(
    session: SessionView,
    *,
    model: str,
    geometry: ModelGeometry,
    cache: CacheInventory | None,
    sender_cache: CacheInventory | None = None,
    pool: PoolState,
    pooled: PooledPrefix | None = None,
    mappers: Sequence[MapperInfo] = (),
    costs: Costs,
    may_persist: bool = True,
    persist_note: str = "",
) -> Plan:
    """Choose the cheapest valid resume path for a turn of `session` served by `model`.

    Args:
        session: the session before the turn.
        model: the model requested for this turn (the receiver when it differs from `last_model`).
        geometry: the requested model's window W and compression-group alignment.
        cache: verified stored global KV of the requested model for this turn's prompt (None: not looked
            up); it may extend past the history (found by content) but never covers the whole prompt.
        sender_cache: on a model switch, verified stored global KV of the last model; for a new session,
            that of another model whose stored prefix of the prompt was found by content (the model-swap
            rules apply to it: only through a validated mapper).
        pool: the session's pool entry.
        pooled: verified pool windows of a prompt prefix found by content (this session's entry or
            another's of the tenant), with the stored global KV of exactly that prefix.
        mappers: registered mappers (any pairs; only validated ones for last_model -> model count).
        costs: per-token costs of the requested model.
        may_persist: False when residency forbids storing this tenant's KV on this node.
        persist_note: why not, said to the caller.

    Returns:
        The plan of the cheapest valid path; ties go to the more exact path.

    Raises:
        ValueError: inconsistent inputs (an inventory of another model, a stored or pooled prefix that is
            not shorter than the prompt).
    """
    if not model:
        raise ValueError("requested model must be non-empty")
    if session.history_len == 0 and sender_cache is not None and sender_cache.model != model:
        candidates = _content_swap_candidates(
            session, model, geometry, cache, sender_cache, pool, pooled, mappers
        )
    elif session.history_len == 0 or session.last_model == model:
        candidates = _same_model_candidates(session, model, geometry, cache, pool, pooled)
    else:
        sender = session.last_model
        assert sender is not None
        candidates = [
            c
            for c in _same_model_candidates(session, model, geometry, cache, pool, pooled)
            if c.path != ResumePath.COLD_PREFILL
        ]
        mapper = _best_mapper(mappers, sender, model)
        sender_prefix = _checked_prefix(session, sender_cache, sender)
        cold_code = PlanReason.COLD_CHEAPER
        if mapper is None:
            cold_reason, cold_code = no_mapper_reason(sender, model), PlanReason.NO_VALIDATED_MAPPER
        elif sender_prefix == 0:
            why = sender_cache.miss_reason if sender_cache is not None and sender_cache.miss_reason else None
            cold_reason = f"nothing stored for {sender} to map: {why or 'nothing stored'}"
            cold_code = PlanReason.NOTHING_STORED_TO_MAP
        else:
            cold_reason = (
                f"cold prefill on {model} is cheaper than mapping {sender_prefix} tokens from {sender}"
            )
            assert sender_cache is not None
            candidates.append(
                _swap(
                    session, geometry, model, sender_cache, sender_prefix, mapper,
                    PlanReason.MAPPED_FROM_LAST_MODEL,
                )
            )
        candidates.append(_cold(session, geometry, cold_reason, cold_code))
    priced = sorted(
        ((estimate_seconds(c.path, c.counts, costs), _TIE_ORDER[c.path], c) for c in candidates),
        key=lambda t: (t[0], t[1]),
    )
    seconds, _, best = priced[0]
    reason = best.reason
    # A cold prefill that won on cost among valid reuse paths says so; one that was the only option keeps
    # its miss reason.
    if best.path == ResumePath.COLD_PREFILL and len(priced) > 1 and "cheaper" in best.reason:
        reason = f"{best.reason} (est {seconds:.4g} s vs {priced[1][0]:.4g} s)"
    return Plan(
        path=best.path,
        model=model,
        reason=reason,
        reason_code=best.reason_code,
        counts=best.counts,
        resume_from=best.resume_from,
        replay_from=best.replay_from,
        source_model=best.source_model,
        mapper_id=best.mapper_id,
        persist=may_persist,
        persist_note="" if may_persist else (persist_note or "residency policy forbids storing KV here"),
        estimated_s=seconds,
        alternatives=tuple((c.path, s) for s, _, c in priced),
    )
