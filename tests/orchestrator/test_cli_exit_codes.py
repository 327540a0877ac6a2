"""`kvresume`'s exit codes (0 ok, 1 failure with one `kvresume <command>: error: ...` line on stderr,
2 usage), as `--help` documents them, and `--json [PATH|-]` on every command."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from orchestrator.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, build_parser, main
from orchestrator.cli.command_parser import CommandParser
from tests.orchestrator.engine.node_harness import TOKENS, registry, start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    with capture_logs():
        n = start_node(tmp_path_factory.mktemp("cli-exit"), registry())
        try:
            yield n
        finally:
            n.stop()


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """(command path, leaf parser) of every runnable command, deferred options added."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


def test_help_documents_the_exit_codes(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == EXIT_OK
    out = capsys.readouterr().out
    section = out[out.index("exit codes:"):].split("\n\n")[0].splitlines()[1:]
    codes = {line.split()[0]: line for line in section if line.split()[0].isdigit()}
    assert sorted(codes) == ["0", "1", "2"]
    assert "success" in codes["0"] and "failure" in codes["1"] and "usage" in codes["2"]
    assert "--json [PATH|-]" in out


def test_every_command_takes_json_with_an_optional_path() -> None:
    leaves = list(_leaves(build_parser()))
    assert len(leaves) > 30
    for path, leaf in leaves:
        assert isinstance(leaf, CommandParser)
        leaf.load_options()
        flag = {a.dest: a for a in leaf._actions}.get("json")
        assert flag is not None, f"kvresume {' '.join(path)} has no --json"
        assert (flag.nargs, flag.const, flag.default) == ("?", "-", None), " ".join(path)


@pytest.mark.parametrize(
    "argv",
    [["nosuch"], ["session", "list", "--bogus"], ["session", "get"], ["session"], ["models", "get"]],
    ids=["unknown-command", "unknown-option", "missing-argument", "missing-subcommand", "models-get"],
)
def test_usage_errors_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_USAGE
    assert "usage: kvresume" in capsys.readouterr().err


def test_failures_exit_1_with_one_line(node, monkeypatch, capsys) -> None:
    monkeypatch.delenv("KVRESUME_TOKEN", raising=False)
    monkeypatch.delenv("KVRESUME_TARGET", raising=False)
    target = ["--target", f"127.0.0.1:{node.server.port}"]
    cases = {
        # the server refuses: the status, its reason and the message, in one line
        ("session", "get", "missing", *target, "--token", TOKENS["acme"]):
            "kvresume session get: error: NOT_FOUND [SESSION_NOT_FOUND]: session missing not found",
        ("models", "list", *target, "--token", "wrong"):
            "kvresume models list: error: UNAUTHENTICATED [UNAUTHENTICATED]: unknown bearer token",
        # no token anywhere: said before any call
        ("session", "list", *target): "kvresume session list: error: no tenant token: pass --token or set "
        "KVRESUME_TOKEN",
        # a bad value of a flag
        ("session", "turn", "sid", "--tokens", "1,x", *target, "--token", TOKENS["acme"]):
            "kvresume session turn: error: --tokens must be comma-separated token ids, got '1,x'",
    }  # fmt: skip
    for argv, line in cases.items():
        assert main(list(argv)) == EXIT_FAILURE, argv
        captured = capsys.readouterr()
        assert captured.err == line + "\n" and captured.out == ""


def test_an_unreachable_server_exits_1(capsys) -> None:
    argv = ["models", "list", "--target", "127.0.0.1:1", "--token", "t", "--timeout", "5"]
    assert main(argv) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith("kvresume models list: error: UNAVAILABLE") and err.count("\n") == 1


def test_success_exits_0(node, capsys) -> None:
    argv = ["models", "list", "--target", f"127.0.0.1:{node.server.port}", "--token", TOKENS["acme"]]
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().err == ""
