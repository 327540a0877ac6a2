"""plan_turn: narrated scenarios for each path and reason, a cost flip, and invariants on random inputs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.planner import (
    CacheInventory,
    Costs,
    MapperInfo,
    ModelGeometry,
    PlanReason,
    PooledPrefix,
    PoolState,
    ResumePath,
    SessionView,
    TokenCounts,
    estimate_seconds,
    plan_turn,
)

GEOM = ModelGeometry(window=128, group=4)
COSTS = Costs(load_s=1e-6, encode_s=1e-4, decode_replay_s=1e-4, map_s=1e-5, pool_restore_s=1e-3)


def _session(history: int, new: int = 10, last: str | None = "small") -> SessionView:
    return SessionView(
        session_id="s-1",
        tenant_id="acme",
        history_len=history,
        new_tokens=new,
        last_model=last if history else None,
    )


def test_plan_turn_new_session_is_cold() -> None:
    plan = plan_turn(
        _session(0, 50), model="small", geometry=GEOM, cache=None, pool=PoolState.absent(), costs=COSTS
    )
    assert plan.path == ResumePath.COLD_PREFILL
    assert plan.reason == "new session: no history to reuse"
    assert plan.counts == TokenCounts(prefilled=50)


def test_plan_turn_full_hit_encodes_only_new_tokens() -> None:
    plan = plan_turn(
        _session(1000, 10),
        model="small",
        geometry=GEOM,
        cache=CacheInventory(model="small", valid_prefix=1000),
        pool=PoolState(model="small", windows_end=1000),
        costs=COSTS,
    )
    assert plan.path == ResumePath.FULL_HIT
    assert plan.counts == TokenCounts(cached=1000, prefilled=10, replayed_decoder=118)
    assert (plan.resume_from, plan.replay_from) == (1000, 1000)
    assert "windows in the pool" in plan.reason


def test_plan_turn_expired_pool_replays_at_most_window_plus_group() -> None:
    plan = plan_turn(
        _session(1001, 10),
        model="small",
        geometry=GEOM,
        cache=CacheInventory(model="small", valid_prefix=1001),
        pool=PoolState.absent(),
        costs=COSTS,
    )
    assert plan.path == ResumePath.GLOBAL_REPLAY
    # Replay starts at the group boundary at or before 1001 - 128 = 873, i.e. 872: 129 tokens re-run.
    assert plan.replay_from == 872
    assert plan.counts == TokenCounts(cached=1001, replayed_encoder=129, prefilled=10, replayed_decoder=118)
    assert (
        plan.reason == "global KV of all 1001 history tokens stored; windows not in the pool, bounded replay"
    )


def test_plan_turn_stale_pool_entry_is_not_a_hit() -> None:
    # Windows that end before the history (a turn finished after they were saved) must not be used.
    plan = plan_turn(
        _session(1000),
        model="small",
        geometry=GEOM,
        cache=CacheInventory(model="small", valid_prefix=1000),
        pool=PoolState(model="small", windows_end=990),
        costs=COSTS,
    )
    assert plan.path == ResumePath.GLOBAL_REPLAY
    assert "pool windows end at 990, history at 1000" in plan.reason


def test_plan_turn_partial_prefix_resumes_from_longest_valid_prefix() -> None:
    cache = CacheInventory(model="small", valid_prefix=768, miss_reason="chunk 3 failed its checksum")
    plan = plan_turn(
        _session(1000, 10),
        model="small",
        geometry=GEOM,
        cache=cache,
        pool=PoolState(model="small", windows_end=1000),
        costs=COSTS,
    )
    assert plan.path == ResumePath.GLOBAL_REPLAY
    assert plan.resume_from == 768
    assert plan.counts == TokenCounts(cached=768, replayed_encoder=128, prefilled=242, replayed_decoder=118)
    assert plan.reason == (
        "global KV of 768 of 1000 history tokens stored (chunk 3 failed its checksum); "
        "pool windows end at 1000, past the stored prefix, bounded replay"
    )


def test_plan_turn_nothing_stored_is_cold_with_the_miss_reason() -> None:
    cache = CacheInventory.empty("small", "purged by tenant request")
    plan = plan_turn(
        _session(500),
        model="small",
        geometry=GEOM,
        cache=cache,
        pool=PoolState(model="small", windows_end=500),
        costs=COSTS,
    )
    assert plan.path == ResumePath.COLD_PREFILL
    assert plan.reason == "nothing usable stored: purged by tenant request"
    assert plan.counts.prefilled == 510 and plan.resume_from == 0


def test_plan_turn_changed_costs_flip_the_decision() -> None:
    # 200 of 1000 tokens stored: reuse saves encoding 200 tokens but re-runs 128 and loads 200.
    cache = CacheInventory(model="small", valid_prefix=200, miss_reason="ceiling reached for later chunks")
    kwargs = dict(model="small", geometry=GEOM, cache=cache, pool=PoolState.absent())
    cheap_load = plan_turn(_session(1000), costs=COSTS, **kwargs)
    assert cheap_load.path == ResumePath.GLOBAL_REPLAY
    slow_disk = Costs(load_s=1e-3, encode_s=1e-4, decode_replay_s=1e-4, map_s=1e-5)
    slow = plan_turn(_session(1000), costs=slow_disk, **kwargs)
    assert slow.path == ResumePath.COLD_PREFILL
    assert slow.reason.startswith("cold prefill is cheaper than reusing the 200 stored tokens (est ")
    assert [p for p, _ in slow.alternatives] == [ResumePath.COLD_PREFILL, ResumePath.GLOBAL_REPLAY]


def test_plan_turn_model_switch_without_mapper_is_cold() -> None:
    plan = plan_turn(
        _session(1000, last="small"),
        model="large",
        geometry=GEOM,
        cache=CacheInventory.empty("large", "nothing stored"),
        sender_cache=CacheInventory(model="small", valid_prefix=1000),
        pool=PoolState.absent(),
        mappers=[],
        costs=COSTS,
    )
    assert plan.path == ResumePath.COLD_PREFILL
    assert plan.reason == "no validated mapper for small -> large"


def test_plan_turn_model_switch_ignores_mapper_that_failed_its_gate() -> None:
    failing = MapperInfo(mapper_id="m-1", sender_model="small", receiver_model="large", passed_gate=False)
    reversed_pair = MapperInfo(
        mapper_id="m-2", sender_model="large", receiver_model="small", passed_gate=True
    )
    plan = plan_turn(
        _session(1000, last="small"),
        model="large",
        geometry=GEOM,
        cache=None,
        sender_cache=CacheInventory(model="small", valid_prefix=1000),
        pool=PoolState.absent(),
        mappers=[failing, reversed_pair],
        costs=COSTS,
    )
    assert plan.path == ResumePath.COLD_PREFILL
    assert plan.reason == "no validated mapper for small -> large"


def test_plan_turn_model_switch_with_validated_mapper_maps() -> None:
    good = MapperInfo(
        mapper_id="m-9", sender_model="small", receiver_model="large", passed_gate=True, score=0.9
    )
    plan = plan_turn(
        _session(1000, last="small"),
        model="large",
        geometry=GEOM,
        cache=None,
        sender_cache=CacheInventory(model="small", valid_prefix=1000),
        pool=PoolState(model="small", windows_end=1000),
        mappers=[good],
        costs=COSTS,
    )
    assert plan.path == ResumePath.MODEL_SWAP
    assert (plan.mapper_id, plan.source_model, plan.model) == ("m-9", "small", "large")
    assert plan.counts == TokenCounts(mapped=1000, replayed_encoder=128, prefilled=10, replayed_decoder=118)


def test_plan_turn_rejects_prefix_covering_the_whole_prompt() -> None:
    with pytest.raises(ValueError, match="not shorter than session s-1's prompt of 110 tokens"):
        plan_turn(
            _session(100, 10),
            model="small",
            geometry=GEOM,
            cache=CacheInventory(model="small", valid_prefix=110),
            pool=PoolState.absent(),
            costs=COSTS,
        )
    with pytest.raises(ValueError, match="pooled prefix of 110 tokens is not shorter"):
        plan_turn(
            _session(100, 10),
            model="small",
            geometry=GEOM,
            cache=CacheInventory(model="small", valid_prefix=100),
            pool=PoolState.absent(),
            pooled=PooledPrefix(model="small", n_tokens=110),
            costs=COSTS,
        )


def test_plan_turn_new_session_reuses_a_stored_prefix_found_by_content() -> None:
    # a new session whose 600-token prompt starts with 512 tokens another session stored
    cache = CacheInventory(model="small", valid_prefix=512, own_prefix=0)
    plan = plan_turn(
        _session(0, 600), model="small", geometry=GEOM, cache=cache, pool=PoolState.absent(), costs=COSTS
    )
    assert plan.path == ResumePath.GLOBAL_REPLAY and plan.reason_code == PlanReason.PREFIX_BY_CONTENT
    assert plan.counts == TokenCounts(cached=512, replayed_encoder=128, prefilled=88)
    assert plan.reason == (
        "global KV of 512 of 600 prompt tokens stored, 512 of them found by content (stored by other "
        "sessions of the tenant); windows not in the pool, bounded replay"
    )


def test_plan_turn_new_session_full_hit_on_pooled_windows_found_by_content() -> None:
    # the agent pattern: the prompt is another session's whole history plus a tool result
    cache = CacheInventory(model="small", valid_prefix=700, own_prefix=0)
    pooled = PooledPrefix(model="small", n_tokens=700)
    plan = plan_turn(
        _session(0, 740),
        model="small",
        geometry=GEOM,
        cache=cache,
        pool=PoolState.absent(),
        pooled=pooled,
        costs=COSTS,
    )
    assert plan.path == ResumePath.FULL_HIT and plan.reason_code == PlanReason.WINDOWS_BY_CONTENT
    assert plan.counts == TokenCounts(cached=700, prefilled=40)
    assert (plan.resume_from, plan.replay_from) == (700, 700)
    assert "pooled by another session of the tenant, found by content" in plan.reason
    # pooled windows of another model never count
    other = plan_turn(
        _session(0, 740),
        model="small",
        geometry=GEOM,
        cache=cache,
        pool=PoolState.absent(),
        pooled=PooledPrefix(model="large", n_tokens=700),
        costs=COSTS,
    )
    assert other.path == ResumePath.GLOBAL_REPLAY


def test_plan_turn_own_full_hit_survives_a_longer_stored_prefix() -> None:
    # the stored prefix reaches into the new tokens (found by content) while the session's own pool entry
    # continues its history: both a full hit at the history's end and a replay from further on are valid
    cache = CacheInventory(model="small", valid_prefix=1024, own_prefix=1000)
    pooled = PooledPrefix(model="small", n_tokens=1000, own=True)
    plan = plan_turn(
        _session(1000, 30),
        model="small",
        geometry=GEOM,
        cache=cache,
        pool=PoolState(model="small", windows_end=1000),
        pooled=pooled,
        costs=COSTS,
    )
    assert plan.path == ResumePath.FULL_HIT and plan.reason_code == PlanReason.WINDOWS_IN_POOL
    assert plan.counts.cached == 1000 and plan.counts.prefilled == 30
    assert {p for p, _ in plan.alternatives} == {
        ResumePath.FULL_HIT,
        ResumePath.GLOBAL_REPLAY,
        ResumePath.COLD_PREFILL,
    }
    replay = plan_turn(
        _session(1000, 30),
        model="small",
        geometry=GEOM,
        cache=cache,
        pool=PoolState.absent(),
        costs=COSTS,
    )
    assert replay.path == ResumePath.GLOBAL_REPLAY and replay.reason_code == PlanReason.PREFIX_BY_CONTENT
    assert replay.counts.cached == 1024 and replay.counts.prefilled == 6


def test_plan_turn_rejects_inventory_of_another_model() -> None:
    with pytest.raises(ValueError, match="inventory of model 'large'"):
        plan_turn(
            _session(100),
            model="small",
            geometry=GEOM,
            cache=CacheInventory(model="large", valid_prefix=10),
            pool=PoolState.absent(),
            costs=COSTS,
        )


def test_plan_turn_residency_forbids_persisting() -> None:
    plan = plan_turn(
        _session(0, 5),
        model="small",
        geometry=GEOM,
        cache=None,
        pool=PoolState.absent(),
        costs=COSTS,
        may_persist=False,
        persist_note="region eu-1 not in [us-1]",
    )
    assert not plan.persist and plan.persist_note == "region eu-1 not in [us-1]"


def _reference_choice(session, model, cache, sender_cache, pool, mappers, costs, geom, pooled=None):
    """Slow twin: enumerate every path, keep those the architecture's table allows, take the cheapest."""
    total = session.prompt_len
    dec = max(0, min(geom.window, total) - session.new_tokens)
    options = [(ResumePath.COLD_PREFILL, TokenCounts(prefilled=total, replayed_decoder=dec))]

    def replay(prefix):
        start = max(0, prefix - geom.window)
        return prefix - (start - start % geom.group)

    n = session.history_len
    if pooled is not None and pooled.model == model:
        p = pooled.n_tokens
        options.append(
            (ResumePath.FULL_HIT, TokenCounts(cached=p, prefilled=total - p, replayed_decoder=dec))
        )
    if cache is not None and cache.valid_prefix:
        p = cache.valid_prefix
        options.append(
            (
                ResumePath.GLOBAL_REPLAY,
                TokenCounts(cached=p, replayed_encoder=replay(p), prefilled=total - p, replayed_decoder=dec),
            )
        )
        if n and p == n and pool.model == model and pool.windows_end == n:
            options.append(
                (ResumePath.FULL_HIT, TokenCounts(cached=p, prefilled=total - p, replayed_decoder=dec))
            )
    if n and session.last_model != model and sender_cache is not None and sender_cache.valid_prefix:
        if any(
            m.passed_gate and (m.sender_model, m.receiver_model) == (session.last_model, model)
            for m in mappers
        ):
            p = sender_cache.valid_prefix
            options.append(
                (
                    ResumePath.MODEL_SWAP,
                    TokenCounts(
                        mapped=p, replayed_encoder=replay(p), prefilled=total - p, replayed_decoder=dec
                    ),
                )
            )
    return min(estimate_seconds(p, c, costs) for p, c in options), options


@settings(max_examples=300, deadline=None)
@given(
    history=st.integers(0, 3000),
    new=st.integers(1, 300),
    prefix_frac=st.floats(0, 1),
    sender_frac=st.floats(0, 1),
    pool_kind=st.sampled_from(["none", "exact", "stale", "other"]),
    switch=st.booleans(),
    mapper_kind=st.sampled_from(["none", "failed", "passed"]),
    window=st.integers(1, 300),
    group=st.sampled_from([1, 2, 4, 128]),
    load=st.floats(0, 1e-3),
    encode=st.floats(1e-6, 1e-3),
    mapc=st.floats(0, 1e-3),
    content=st.sampled_from(["none", "stored", "pooled"]),
    content_frac=st.floats(0, 1),
)
def test_plan_turn_matches_reference_on_random_inputs(
    history,
    new,
    prefix_frac,
    sender_frac,
    pool_kind,
    switch,
    mapper_kind,
    window,
    group,
    load,
    encode,
    mapc,
    content,
    content_frac,
) -> None:
    geom = ModelGeometry(window=window, group=group)
    costs = Costs(load_s=load, encode_s=encode, decode_replay_s=encode, map_s=mapc, pool_restore_s=1e-4)
    last = "small" if history else None
    model = "large" if (switch and history) else "small"
    session = SessionView(session_id="s", tenant_id="t", history_len=history, new_tokens=new, last_model=last)
    cache = CacheInventory(model=model, valid_prefix=int(history * prefix_frac))
    pooled = None
    if content != "none":
        # found by content: a stored prefix (and maybe pooled windows at its end) reaching into the new tokens
        reach = int((history + new - 1) * content_frac)
        cache = CacheInventory(model=model, valid_prefix=reach, own_prefix=min(reach, cache.valid_prefix))
        if content == "pooled" and reach:
            pooled = PooledPrefix(model=model, n_tokens=reach)
    sender_cache = (
        CacheInventory(model="small", valid_prefix=int(history * sender_frac)) if model != last else None
    )
    pool = {
        "none": PoolState.absent(),
        "exact": PoolState(model=model, windows_end=history),
        "stale": PoolState(model=model, windows_end=max(0, history - 1)),
        "other": PoolState(model="other", windows_end=history),
    }[pool_kind]
    mappers = (
        []
        if mapper_kind == "none"
        else [
            MapperInfo(
                mapper_id="m",
                sender_model="small",
                receiver_model="large",
                passed_gate=mapper_kind == "passed",
            )
        ]
    )
    plan = plan_turn(
        session,
        model=model,
        geometry=geom,
        cache=cache,
        sender_cache=sender_cache,
        pool=pool,
        pooled=pooled,
        mappers=mappers,
        costs=costs,
    )
    best, options = _reference_choice(session, model, cache, sender_cache, pool, mappers, costs, geom, pooled)
    assert (plan.path, plan.counts) in options
    assert plan.estimated_s == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert plan.counts.prompt_tokens == history + new
    assert plan.counts.replayed_encoder <= window + group - 1
    if plan.path == ResumePath.COLD_PREFILL:
        assert plan.resume_from == 0


def test_plan_turn_new_session_maps_a_prefix_another_model_stored() -> None:
    # the router's cascade: the conversation was served by "small", this request asks for "large"
    sender = CacheInventory(model="small", valid_prefix=600, own_prefix=0)
    good = MapperInfo(mapper_id="m-1", sender_model="small", receiver_model="large", passed_gate=True)
    kwargs = dict(model="large", geometry=GEOM, cache=None, sender_cache=sender, pool=PoolState.absent())
    plan = plan_turn(_session(0, 640), mappers=[good], costs=COSTS, **kwargs)
    assert plan.path == ResumePath.MODEL_SWAP and plan.reason_code == PlanReason.MAPPED_BY_CONTENT
    assert (plan.mapper_id, plan.source_model) == ("m-1", "small")
    assert plan.counts == TokenCounts(mapped=600, replayed_encoder=128, prefilled=40)
    assert plan.reason.startswith(
        "small -> large via mapper m-1: global KV of 600 of 640 prompt tokens stored"
    )
    # a mapper whose evaluation measured task retention: the reason quotes it
    measured = dataclasses.replace(good, retention=0.9731)
    quoted = plan_turn(_session(0, 640), mappers=[measured], costs=COSTS, **kwargs)
    assert quoted.reason.startswith("small -> large via mapper m-1 (task retention 0.973): global KV of 600")
    # without a validated mapper nothing of "small" is used: a new session's cold prefill
    failed = MapperInfo(mapper_id="m-2", sender_model="small", receiver_model="large", passed_gate=False)
    cold = plan_turn(_session(0, 640), mappers=[failed], costs=COSTS, **kwargs)
    assert cold.path == ResumePath.COLD_PREFILL and cold.reason_code == PlanReason.NEW_SESSION
    # mapping that costs more than a cold prefill says so
    dear = Costs(load_s=1e-6, encode_s=1e-4, decode_replay_s=1e-4, map_s=1.0)
    cheaper = plan_turn(_session(0, 640), mappers=[good], costs=dear, **kwargs)
    assert cheaper.path == ResumePath.COLD_PREFILL and cheaper.reason_code == PlanReason.COLD_CHEAPER
    assert cheaper.reason.startswith("cold prefill on large is cheaper than mapping 600 tokens from small")
