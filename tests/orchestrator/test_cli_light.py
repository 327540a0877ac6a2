"""The client commands run without the model stack: `kvresume --help`, `session list`, `models list`, an
Admin call and `mapper list` in a child process where a finder refuses to import torch, numpy, SQL,
storage, the model and the server halves of orchestrator/ (a time-independent "starts at once" check);
`serve` without tokens is refused there too (before anything heavy loads), and a server command on
such an install names the extra to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.orchestrator.engine.node_harness import ADMIN, TOKENS, registry, start_node

REPO = Path(__file__).resolve().parents[2]

# The child: refuse the heavy modules as an install without them would (ModuleNotFoundError naming the
# module), then run the command line; at exit, print which refused modules were imported anyway.
_CHILD = textwrap.dedent(
    """
    import importlib.abc, json, os, sys

    # The server extra's modules; unless KVRESUME_TEST_OURS_IMPORTABLE is set (an install where our
    # packages are present but their dependencies are not), our heavy packages too.
    BLOCKED = {"torch", "triton", "numpy", "sklearn", "sqlalchemy", "alembic", "rocksdict", "structlog",
               "tokenizers", "safetensors", "prometheus_client"}
    if not os.environ.get("KVRESUME_TEST_OURS_IMPORTABLE"):
        BLOCKED |= {"model", "storage", "mappers", "kernels", "orchestrator.api", "orchestrator.engine",
                    "orchestrator.db", "orchestrator.planner"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name in BLOCKED or name.split(".")[0] in BLOCKED or ".".join(name.split(".")[:2]) in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked in this test)", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    from orchestrator.cli import main

    try:
        rc = main(sys.argv[1:])
    except SystemExit as exc:
        rc = exc.code
    loaded = sorted(m for m in sys.modules if m in BLOCKED or m.split(".")[0] in BLOCKED)
    print(json.dumps({"heavy_loaded": loaded}), file=sys.stderr)
    sys.exit(rc)
    """
)


def _light(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )


def _heavy_loaded(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return json.loads(proc.stderr.strip().splitlines()[-1])["heavy_loaded"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    n = start_node(tmp_path_factory.mktemp("light"), registry())
    try:
        yield n
    finally:
        n.stop()


def test_help_imports_no_torch() -> None:
    proc = _light("--help")
    assert proc.returncode == 0, proc.stderr
    assert "exit codes:" in proc.stdout and "session" in proc.stdout and "models" in proc.stdout
    assert _heavy_loaded(proc) == []


def test_client_commands_run_against_a_real_server_without_the_model_stack(node) -> None:
    target = ["--target", f"127.0.0.1:{node.server.port}"]
    tenant = [*target, "--token", TOKENS["acme"]]
    runs = {
        "session list": _light("session", "list", *tenant),
        "session list --json": _light("session", "list", *tenant, "--json"),
        "models list": _light("models", "list", *tenant),
        "admin stats": _light("admin", "stats", *target, "--token", ADMIN),
        "mapper list": _light("mapper", "list", *tenant),
    }
    for name, proc in runs.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
        assert _heavy_loaded(proc) == [], name
    assert runs["session list"].stdout.strip() == "no sessions"
    assert json.loads(runs["session list --json"].stdout) == {"next_page_token": "", "sessions": []}
    assert [line.split()[0] for line in runs["models list"].stdout.splitlines()] == ["name", "a", "b"]


def test_serve_without_tokens_is_refused_before_anything_heavy_loads(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRESUME_")}
    proc = _light("serve", "--data-dir", str(tmp_path), "--port", "0", env=env)
    assert proc.returncode == 1
    assert "kvresume serve: error: no tenant tokens are configured" in proc.stderr
    assert "KVRESUME_TENANT_TOKENS" in proc.stderr and "--insecure-dev" in proc.stderr
    assert _heavy_loaded(proc) == []
    # --insecure-dev is for a loopback host only
    proc = _light("serve", "--insecure-dev", "--host", "0.0.0.0", "--data-dir", str(tmp_path), env=env)
    assert proc.returncode == 1 and "only on a loopback host" in proc.stderr
    assert not (tmp_path / "registry.sqlite3").exists()


@pytest.mark.parametrize(
    "argv",
    [["model", "bytes", "--preset", "v41-tiny"], ["train", "--help"], ["demo"]],
    ids=["model-bytes", "train-help", "demo"],
)
def test_a_server_command_without_the_server_install_names_the_extra(argv: list[str]) -> None:
    # the light install: our packages are there, torch and the rest of the server extra are not
    proc = _light(*argv, env={**os.environ, "KVRESUME_TEST_OURS_IMPORTABLE": "1"})
    assert proc.returncode == 1, proc.stderr
    assert "pip install 'kvresume[server]'" in proc.stderr
    assert "Traceback" not in proc.stderr
