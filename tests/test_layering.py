"""The import graph of our packages follows STYLE.md rule 1; cross-package imports use package roots."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("orchestrator", "model", "kernels", "mappers", "storage", "proto", "migrations")

# Which of our packages each package may import (STYLE.md rule 1).
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "model": {"kernels"},
    "mappers": {"model", "kernels"},
    "storage": set(),
    "orchestrator": {"model", "kernels", "mappers", "storage", "proto"},
    "migrations": {"orchestrator"},
    "proto": set(),
}
# Third-party modules a package must never import.
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "storage": {"torch", "triton"},
    "kernels": {"grpc", "sqlalchemy", "rocksdict"},
    "model": {"grpc", "sqlalchemy", "rocksdict"},
}
# migrations/ may read only the SQL metadata and the settings object of orchestrator/ (rules 1 and 4).
MIGRATIONS_MAY_READ = {"orchestrator.db.models", "orchestrator.settings"}


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def _package_files(package: str) -> list[Path]:
    base = ROOT / package
    return [p for p in base.rglob("*.py") if "_generated" not in p.parts]


def _violations(package: str) -> list[str]:
    bad: list[str] = []
    for path in _package_files(package):
        for module, line in _imports(path):
            top = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if top in OURS and top != package:
                if top not in ALLOWED[package]:
                    bad.append(f"{where}: {package}/ may not import {top}/")
                elif package == "migrations":
                    if not any(module == m or module.startswith(m + ".") for m in MIGRATIONS_MAY_READ):
                        bad.append(f"{where}: migrations/ may read only {sorted(MIGRATIONS_MAY_READ)}")
                elif module != top and top != "proto":
                    bad.append(f"{where}: import {top}/ from its package root (STYLE.md rule 7)")
            if top in FORBIDDEN_THIRD_PARTY.get(package, set()):
                bad.append(f"{where}: {package}/ must not depend on {top}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layering_imports_follow_style_rule_1(package: str) -> None:
    assert (ROOT / package).is_dir(), f"missing package {package}/"
    bad = _violations(package)
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_layering_detects_a_forbidden_edge(tmp_path: Path) -> None:
    # The checker itself must be able to fail: parse a synthetic storage module that imports torch.
    fake = tmp_path / "bad.py"
    fake.write_text("import torch\nfrom model.config import ModelConfig\n")
    modules = {m for m, _ in _imports(fake)}
    assert modules == {"torch", "model.config"}
    assert "torch" in FORBIDDEN_THIRD_PARTY["storage"]
    assert "model" not in ALLOWED["storage"]


@pytest.mark.parametrize("package", ["orchestrator.engine", "orchestrator.api"])
def test_lazy_package_names_resolve_to_their_modules(package: str) -> None:
    """orchestrator.engine and orchestrator.api import their names on first use: every name of `__all__`
    has its module in the map and resolves to what that module defines."""
    import importlib

    lazy = importlib.import_module(package)
    homes = lazy._HOMES  # noqa: SLF001 - the map under test
    assert set(homes) == set(lazy.__all__)
    for name, home in homes.items():
        assert getattr(lazy, name) is getattr(importlib.import_module(home), name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        lazy.no_such_name  # noqa: B018 - the lookup is the test


def test_the_model_process_imports_no_registry_server_or_turn_engine() -> None:
    """What the model process imports (its entry point, and the served models and compute it loads)
    pulls in neither SQLAlchemy, Alembic nor grpc, nor the service's context or turn engine: what the lazy
    packages are for (about 1.6 s of every model process's start on the 2-vCPU VMs when it did)."""
    import subprocess
    import sys

    probe = (
        "import sys, orchestrator.model_process.__main__, orchestrator.engine.served_models, "
        "orchestrator.engine.model_compute, orchestrator.engine.decoded_states; "
        "print(sorted(m for m in ('sqlalchemy', 'alembic', 'grpc', 'orchestrator.engine.service', "
        "'orchestrator.engine.turn_engine', 'orchestrator.api.context') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
