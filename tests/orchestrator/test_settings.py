"""load_settings: precedence defaults < TOML < environment < overrides; unknown keys and bad values fail."""

from __future__ import annotations

import pytest

from orchestrator.settings import Settings, load_settings


def test_load_settings_precedence(tmp_path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text('region = "eu-1"\ngrpc_port = 6000\nmetrics_port = 9100\n[tenant_tokens]\nacme = "t1"\n')
    env = {
        "KVRESUME_GRPC_PORT": "6001",
        "KVRESUME_DATABASE_URL": "postgresql+psycopg://db/x",
        "KVRESUME_TENANT_TOKENS": "acme=t2,globex=t3",
    }
    s = load_settings(toml_path=toml, environ=env, overrides={"grpc_port": 6002, "metrics_port": None})
    assert (s.region, s.grpc_port, s.metrics_port) == ("eu-1", 6002, 9100)
    assert s.resolved_database_url == "postgresql+psycopg://db/x"
    assert s.tenant_tokens == {"acme": "t2", "globex": "t3"}
    assert "t2" not in repr(s)


def test_load_settings_default_sqlite_in_data_dir(tmp_path) -> None:
    s = load_settings(environ={"KVRESUME_DATA_DIR": str(tmp_path)})
    assert s.resolved_database_url == f"sqlite:///{tmp_path.resolve() / 'registry.sqlite3'}"


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ("grcp_port = 1\n", "unknown settings keys in .*: \\['grcp_port'\\]"),
        ("grpc_port = 70000\n", "grpc_port=70000 is not a TCP port"),
        ('grpc_port = "x1"\n', "invalid literal"),
        ("max_turn_tokens = 0\n", "max_turn_tokens=0 must be positive"),
        ('tls_cert_file = "/c.pem"\n', "TLS needs both"),
        ('admin_token = "same"\n[tenant_tokens]\na = "same"\n', "admin token must differ"),
        ("version = 2\n", "settings version 2"),
        ('child_start = "fork"\n', "child_start='fork' must be one of preloaded, exec"),
    ],
)
def test_load_settings_rejects_bad_values(tmp_path, toml: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=match):
        load_settings(toml_path=path, environ={})


def test_load_settings_rejects_unknown_override() -> None:
    with pytest.raises(ValueError, match="unknown setting override 'prot'"):
        load_settings(environ={}, overrides={"prot": 1})


def test_settings_is_frozen_and_copies_tokens() -> None:
    tokens = {"a": "x"}
    s = Settings(tenant_tokens=tokens)
    tokens["b"] = "y"
    assert s.tenant_tokens == {"a": "x"}
    with pytest.raises(AttributeError):
        s.region = "elsewhere"  # type: ignore[misc]


def test_the_step_budget_setting_defaults_to_the_schedulers_default() -> None:
    from orchestrator.scheduler import DEFAULT_STEP_TOKEN_BUDGET

    # settings.py imports nothing of ours, so it spells the default out; the two must not drift apart
    assert Settings().step_token_budget == DEFAULT_STEP_TOKEN_BUDGET
