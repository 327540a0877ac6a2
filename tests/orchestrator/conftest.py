"""Fixtures of the orchestrator tests: migrated tmp SQLite registries and a fresh PostgreSQL schema.

PostgreSQL: `KVRESUME_TEST_POSTGRES_URL` names the server (`.ci/run` sets it). Unset, the PostgreSQL
tests skip, unless `KVRESUME_REQUIRE_POSTGRES=1`, which makes them fail; an unreachable server fails
when required and skips otherwise. Each test session works in its own schema, dropped at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from orchestrator.db.engine import make_engine, scratch_schema
from orchestrator.db.migrate import upgrade


def _required() -> bool:
    return os.environ.get("KVRESUME_REQUIRE_POSTGRES", "") not in ("", "0")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A tmp-file SQLite database migrated with `alembic upgrade head`."""
    url = f"sqlite:///{tmp_path / 'registry.sqlite3'}"
    upgrade(url)
    return url


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    engine = make_engine(sqlite_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    url = os.environ.get("KVRESUME_TEST_POSTGRES_URL", "")
    if not url:
        if _required():
            pytest.fail("KVRESUME_REQUIRE_POSTGRES is set but KVRESUME_TEST_POSTGRES_URL is not")
        pytest.skip("KVRESUME_TEST_POSTGRES_URL is not set (run .ci/run for the PostgreSQL tests)")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("select 1"))
    except Exception as exc:  # noqa: BLE001 - any connection failure means "unreachable" here
        if _required():
            pytest.fail(f"PostgreSQL at {make_url(url).render_as_string()} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL unreachable: {exc}")
    finally:
        engine.dispose()
    return url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, empty schema on the PostgreSQL server (search_path points at it); dropped afterwards."""
    with scratch_schema(postgres_server_url, "kvr_test_") as url:
        yield url
