"""Alembic revisions: upgrade to head creates the schema the models declare; downgrade removes it."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from orchestrator.db.engine import make_engine
from orchestrator.db.migrate import downgrade, upgrade
from orchestrator.db.models import metadata

TABLES = {
    "audit_head",
    "tenants",
    "policies",
    "sessions",
    "turns",
    "cache_segments",
    "session_segments",
    "mappers",
    "audit_log",
    "fit_jobs",
}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _check_round_trip(url: str) -> None:
    upgrade(url)
    assert _tables(url) == TABLES == set(metadata.tables)
    downgrade(url, "base")
    assert _tables(url) == set()
    upgrade(url)
    assert _tables(url) == TABLES


def test_upgrade_downgrade_sqlite(tmp_path) -> None:
    _check_round_trip(f"sqlite:///{tmp_path / 'r.sqlite3'}")


def test_upgrade_downgrade_postgres(postgres_url: str) -> None:
    _check_round_trip(postgres_url)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_upgrade_head_matches_models(backend: str, tmp_path, request) -> None:
    # Autogenerate against a migrated database must find nothing to do: revisions and models agree.
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    url = (
        f"sqlite:///{tmp_path / 'r.sqlite3'}"
        if backend == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
    finally:
        engine.dispose()
    assert diff == [], diff
