"""create_session on SQLite through the driver (`SessionCreate` on a Connection) against its twin, the
repositories in an ORM Session: two registries with the same random tenants, policies and session counts
(some at the limit) get the same random creations, each way, with the same session ids and salts; the
results, refusals and whole tables must agree."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import random
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import select

from orchestrator.api import ResourceExhaustedError, build_context
from orchestrator.api.turn_runner import create_session
from orchestrator.db import PolicyRepository, TenantRepository, run_serializable
from orchestrator.db.models import Policy, SessionRow, Tenant
from tests.orchestrator.api.conftest import make_settings


def _dump(ctx: Any) -> dict[str, list[tuple]]:
    out = {}
    with ctx.engine.connect() as conn:
        for model in (Tenant, Policy, SessionRow):
            table = model.__table__
            rows = conn.execute(select(table).order_by(*table.primary_key.columns)).all()
            out[table.name] = [
                tuple(type(v) if isinstance(v, dt.datetime) else v for v in row) for row in rows
            ]
    return out


def _converted(row: SessionRow) -> tuple:
    """What a converter reads of the row (the stamps as their type: two runs stamp differently)."""
    return tuple(
        type(v) if isinstance(v, dt.datetime) else v
        for v in (
            row.id,
            row.tenant_id,
            row.model,
            row.status,
            row.turn_count,
            row.history_tokens,
            row.retention_s,
            row.parent_session_id,
            row.forked_at_turn,
            row.created_at,
            row.updated_at,
        )
    )


def test_create_session_on_the_driver_matches_the_session_path(tmp_path: Path, monkeypatch) -> None:
    rng = random.Random(secrets.randbits(64))
    # the same ids and salts for both registries, from counters reset before each one's run
    ids = SimpleNamespace(n=itertools.count(), salt=itertools.count())

    def uuid4() -> Any:
        return SimpleNamespace(hex=f"{next(ids.n):032x}")

    def token_bytes(n: int) -> bytes:
        return next(ids.salt).to_bytes(n, "big")

    import orchestrator.db.repositories.session_create as driver_module
    import orchestrator.db.repositories.sessions as sessions_module
    import orchestrator.db.repositories.tenants as tenants_module

    for module in (sessions_module, driver_module):
        monkeypatch.setattr(module, "uuid", SimpleNamespace(uuid4=uuid4))
    for module in (tenants_module, driver_module):
        monkeypatch.setattr(module, "secrets", SimpleNamespace(token_bytes=token_bytes))

    tenants = ["acme", "globex", "initech", "umbrella"]
    known = rng.sample(tenants, rng.randrange(len(tenants)))
    policies = {
        t: (rng.choice([0.0, 5.0, 60.0]), rng.choice([30.0, 600.0, 86400.0]))
        for t in known
        if rng.random() < 0.6
    }
    script = [
        (rng.choice(tenants), rng.choice(["a", "b"]), rng.choice([None, 1.0, 45.0, 1e9]))
        for _ in range(rng.randrange(8, 20))
    ]
    limit = rng.choice([2, 3])
    results: dict[bool, list[Any]] = {}
    dumps: dict[bool, dict[str, list[tuple]]] = {}
    for driver in (True, False):
        ids.n, ids.salt = itertools.count(), itertools.count()
        tmp = tmp_path / ("driver" if driver else "session")
        tmp.mkdir()
        ctx = build_context(dataclasses.replace(make_settings(tmp), max_sessions_per_tenant=limit))
        try:
            assert (ctx.session_create is not None) and ctx.engine.dialect.name == "sqlite"

            def fill(s: Any) -> None:
                for t in known:
                    TenantRepository(s).ensure(t)
                for t, (floor, ceiling) in policies.items():
                    PolicyRepository(s).set(t, floor_s=floor, ceiling_s=ceiling, allowed_regions=[])

            run_serializable(ctx.serializable, fill)
            seen: list[Any] = []
            for tenant, model, hint in script:
                try:
                    row, granted = create_session(
                        ctx,
                        tenant_id=tenant,
                        model=model,
                        retention_hint_s=hint,
                        convert=_converted,
                        driver=driver,
                    )
                    seen.append((row, granted))
                except ResourceExhaustedError as exc:
                    seen.append(("refused", str(exc)))
            results[driver] = seen
            dumps[driver] = _dump(ctx)
        finally:
            ctx.close()
    assert results[True] == results[False]
    assert dumps[True] == dumps[False]
    assert any(r[0] != "refused" for r in results[True]), "nothing was created"


@pytest.mark.parametrize("model", [""])
def test_the_driver_refuses_an_empty_model_as_the_repository_does(tmp_path: Path, model: str) -> None:
    ctx = build_context(make_settings(tmp_path))
    try:
        for driver in (True, False):
            with pytest.raises(ValueError, match="model must be non-empty"):
                create_session(
                    ctx,
                    tenant_id="acme",
                    model=model,
                    retention_hint_s=None,
                    convert=_converted,
                    driver=driver,
                )
        # neither left the tenant it registered on the way
        assert _dump(ctx)["tenants"] == []
    finally:
        ctx.close()
