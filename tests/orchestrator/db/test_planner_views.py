"""session_view and mapper_infos feed the planner from registry rows: a gated mapper in SQL enables a swap."""

from __future__ import annotations

from orchestrator.db import (
    MapperRegistration,
    MapperRepository,
    SessionRepository,
    TenantRepository,
    TurnRepository,
    TurnTimings,
    make_session_factory,
    mapper_infos,
    session_view,
)
from orchestrator.planner import (
    BUILTIN_COSTS,
    CacheInventory,
    ModelGeometry,
    PoolState,
    ResumePath,
    plan_turn,
)


def test_registry_rows_drive_the_planner(sqlite_engine) -> None:
    factory = make_session_factory(sqlite_engine)
    with factory() as s, s.begin():
        TenantRepository(s).ensure("acme")
        row = SessionRepository(s).create(tenant_id="acme", model="small", retention_s=60)
        assert session_view(row, new_tokens=4).last_model is None
        turns = TurnRepository(s)
        t = turns.begin(row, model="small", input_tokens=list(range(300)))
        turns.finish(t, row, output_tokens=[1, 2], timings=TurnTimings())
        mappers = MapperRepository(s)
        mappers.register(
            MapperRegistration(
                mapper_id="m-fail",
                sender_model="small",
                receiver_model="large",
                artifact_uri="a",
                metrics={"retention": 0.5},
                gate_metric="retention",
                gate_threshold=0.9,
                passed_gate=False,
            )
        )
        view = session_view(row, new_tokens=4)
        assert (view.history_len, view.last_model) == (302, "small")
        kwargs = dict(
            model="large",
            geometry=ModelGeometry(window=128, group=4),
            cache=None,
            sender_cache=CacheInventory(model="small", valid_prefix=302),
            pool=PoolState.absent(),
            costs=BUILTIN_COSTS,
        )
        cold = plan_turn(view, mappers=mapper_infos(mappers.list()), **kwargs)
        assert (cold.path, cold.reason) == (ResumePath.COLD_PREFILL, "no validated mapper for small -> large")
        mappers.register(
            MapperRegistration(
                mapper_id="m-ok",
                sender_model="small",
                receiver_model="large",
                artifact_uri="b",
                metrics={"retention": 0.95},
                gate_metric="retention",
                gate_threshold=0.9,
                passed_gate=True,
            )
        )
        infos = mapper_infos(mappers.list())
        assert {i.mapper_id: i.score for i in infos} == {"m-fail": 0.5, "m-ok": 0.95}
        swap = plan_turn(view, mappers=infos, **kwargs)
        assert (swap.path, swap.mapper_id, swap.counts.mapped) == (ResumePath.MODEL_SWAP, "m-ok", 302)
