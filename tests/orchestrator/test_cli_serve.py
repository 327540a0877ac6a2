"""`kvresume serve`'s token rules: no tenant tokens is refused at once (a server that would refuse every
call, issue 15 item 2), `--insecure-dev` stands in the development tokens, on a loopback host only."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.cli.serve_cmd import DEV_ADMIN_TOKEN, DEV_TENANT, DEV_TOKEN, with_tokens
from orchestrator.settings import Settings


def test_no_tenant_tokens_is_refused_naming_the_ways_to_give_them() -> None:
    with pytest.raises(ValueError) as info:
        with_tokens(Settings(), insecure_dev=False)
    for named in ("tenant_tokens", "KVRESUME_TENANT_TOKENS", "KVRESUME_ADMIN_TOKEN", "--insecure-dev"):
        assert named in str(info.value)
    given = Settings(tenant_tokens={"acme": "s1"}, admin_token="adm")
    assert with_tokens(given, insecure_dev=False) is given


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_insecure_dev_fills_in_the_missing_tokens_on_loopback(host: str) -> None:
    dev = with_tokens(Settings(grpc_host=host), insecure_dev=True)
    assert dict(dev.tenant_tokens) == {DEV_TENANT: DEV_TOKEN} and dev.admin_token == DEV_ADMIN_TOKEN
    # configured tokens stay; only the missing one is filled in
    partial = with_tokens(Settings(grpc_host=host, tenant_tokens={"acme": "s1"}), insecure_dev=True)
    assert dict(partial.tenant_tokens) == {"acme": "s1"} and partial.admin_token == DEV_ADMIN_TOKEN


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.org", "::"])
def test_insecure_dev_is_refused_off_loopback(host: str) -> None:
    with pytest.raises(ValueError, match="only on a loopback host"):
        with_tokens(Settings(grpc_host=host), insecure_dev=True)


def test_serve_without_tokens_exits_1_before_touching_the_data_dir(tmp_path, monkeypatch, capsys) -> None:
    for name in ("KVRESUME_TENANT_TOKENS", "KVRESUME_ADMIN_TOKEN", "KVRESUME_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    data = tmp_path / "data"
    assert main(["serve", "--data-dir", str(data), "--port", "0", "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvresume serve: error: no tenant tokens are configured") and err.count("\n") == 1
    assert not data.exists()
