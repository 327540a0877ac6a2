"""Fixtures of the registry tests: one migrated SQLite registry per test session, copied per database."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.db import upgrade


@pytest.fixture(scope="session")
def migrated_registry(tmp_path_factory) -> Path:
    """One migrated registry file (a migration takes a second or two); tests copy it, never write it."""
    path = tmp_path_factory.mktemp("migrated") / "template.sqlite3"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def registry_copy(tmp_path: Path, migrated_registry: Path) -> Callable[[str], str]:
    """name -> the URL of a fresh copy of the migrated registry under this test's tmp_path."""

    def copy(name: str) -> str:
        target = tmp_path / f"{name}.sqlite3"
        shutil.copy(migrated_registry, target)
        return f"sqlite:///{target}"

    return copy
