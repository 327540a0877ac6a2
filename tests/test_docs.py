"""The shell and Python blocks of README.md and orchestrator/README.md, run as written, against a real
`kvresume serve` (issue 15: a wrong example cannot ship again).

Marking. A fenced block whose info string is `sh doctest` (or `python doctest`) runs in the default
suite; `sh doctest slow` runs only with the slow tests (train, a full eval, the demo); `sh doctest skip`
is shown and never run (placeholders such as a PostgreSQL host, and commands that would recurse or
install, such as `make test`). Every `sh`, `bash`, `shell`, `console` or `python` block must carry one of
the three: an unmarked one fails `test_every_command_block_is_marked`.

Running. The default blocks of one README form one bash script, in their order (`set -euo pipefail`:
any failing command fails the test), run in a temp directory that holds a `checkpoints` link to the
repository's, with the venv's `kvresume` and `python` first on PATH, the repository on PYTHONPATH (for
`python -m benchmarks...`), and no KVRESUME_* variable but the test's own: KVRESUME_GRPC_PORT and
KVRESUME_METRICS_PORT and KVRESUME_HTTP_PORT (free ports) and KVRESUME_TARGET (that gRPC address), so
`kvresume serve` and the client commands meet without a port in the text (the HTTP examples write
`${KVRESUME_HTTP_PORT:-8000}`). A line `[VAR=value ...] kvresume serve ...` starts that
server in the background (stopping the one before it) and waits until it serves (its `--json` file);
the last one stops when the script ends. A python block runs as a file at its place in the script.
Each slow block runs alone, the same way.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "orchestrator/README.md")
_COMMAND_LANGS = {"sh", "bash", "shell", "console", "python"}
_MARKS = {"": "default", "slow": "slow", "skip": "skip"}
_FENCE = re.compile(r"^```(\S*)(.*)$")
# `kvresume serve` at the start of a command, after optional VAR=value assignments
_SERVE = re.compile(r"^(\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S+\s+)*)kvresume serve(?=\s|$)")

_PRELUDE = r"""
set -euo pipefail
PS4='+ doc: '
_doc_pid=
_doc_n=0
_doc_stop() {
  if [ -n "$_doc_pid" ]; then kill "$_doc_pid" 2>/dev/null || true; wait "$_doc_pid" 2>/dev/null || true; fi
  _doc_pid=
}
trap _doc_stop EXIT
_doc_start() {
  _doc_stop
  _doc_n=$((_doc_n + 1))
  local ready="$DOC_DIR/ready-$_doc_n.json" log="$DOC_DIR/serve-$_doc_n.log"
  echo "+ doc: kvresume serve $* (in the background, until it serves)" >&2
  kvresume serve "$@" --json "$ready" >"$log" 2>&1 &
  _doc_pid=$!
  for _ in $(seq 1 900); do
    # the ready file is written once serving; it is complete when it parses
    if [ -s "$ready" ] && python -c 'import json, sys; json.load(open(sys.argv[1]))' "$ready" 2>/dev/null
    then return 0; fi
    if ! kill -0 "$_doc_pid" 2>/dev/null; then
      echo "kvresume serve exited before serving:" >&2; cat "$log" >&2; _doc_pid=; return 1
    fi
    sleep 0.2
  done
  echo "kvresume serve did not serve within 180 s:" >&2; cat "$log" >&2; return 1
}
# _doc_start untraced (its polling loop would fill the trace)
_doc_serve() {
  { set +x; } 2>/dev/null
  local rc=0
  _doc_start "$@" || rc=$?
  set -x
  return "$rc"
}
set -x
"""


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    mark: str | None
    text: str

    @property
    def label(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks(doc: str) -> list[Block]:
    found: list[Block] = []
    lines = (REPO / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        lang, rest = m.group(1), m.group(2).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        mark = None
        if rest[:1] == ["doctest"] and len(rest) <= 2:
            mark = _MARKS.get(rest[1] if len(rest) == 2 else "")
        found.append(Block(doc=doc, line=start, lang=lang, mark=mark, text="\n".join(body) + "\n"))
    return found


def _script(blocks: list[Block], workdir: Path) -> str:
    parts = [_PRELUDE]
    for n, block in enumerate(blocks):
        parts.append(f"# {block.label}")
        if block.lang == "python":
            path = workdir / f"block-{n}.py"
            path.write_text(block.text)
            parts.append(f"python {shlex.quote(str(path))}")
        else:
            parts.append("\n".join(_SERVE.sub(r"\1_doc_serve", line) for line in block.text.splitlines()))
    return "\n".join(parts) + "\n"


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out on its own (Linux's ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _quiet_ports(n: int) -> list[int]:
    """`n` distinct loopback ports, free now, below the kernel's ephemeral range.

    Why not a port the kernel picks (bind to 0): the script stops and starts `kvresume serve` on the same
    ports for minutes, and in between the kernel may give a port of its ephemeral range to any other
    socket (a parallel test's client connection): the next start then found its metrics port taken
    (seen in CI, "metrics address ... is not available"). Below that range only a socket that asks for
    the very port gets it, and a random pick makes two of these scripts meeting unlikely.
    """
    floor = _ephemeral_floor()
    picked: list[int] = []
    rng = random.Random()
    while len(picked) < n:
        port = rng.randrange(10000, max(10001, floor))
        if port in picked:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own check binds
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        picked.append(port)
    return picked


def _run(blocks: list[Block], tmp_path: Path, *, timeout_s: float) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "checkpoints").symlink_to(REPO / "checkpoints")
    grpc_port, metrics_port, http_port = _quiet_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRESUME_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "DOC_DIR": str(tmp_path),
        "KVRESUME_GRPC_PORT": str(grpc_port),
        "KVRESUME_METRICS_PORT": str(metrics_port),
        "KVRESUME_HTTP_PORT": str(http_port),
        "KVRESUME_TARGET": f"127.0.0.1:{grpc_port}",
    }
    script = tmp_path / "doc.sh"
    script.write_text(_script(blocks, tmp_path))
    proc = subprocess.run(
        ["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, (
        f"the blocks {[b.label for b in blocks]} failed (exit {proc.returncode})\n--- stdout\n"
        f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-10000:]}"
    )


def _marked(mark: str) -> list[Block]:
    return [b for doc in DOCS for b in _blocks(doc) if b.mark == mark]


def test_every_command_block_is_marked() -> None:
    unmarked = [b.label for doc in DOCS for b in _blocks(doc) if b.lang in _COMMAND_LANGS and b.mark is None]
    assert not unmarked, f"command blocks without `doctest`, `doctest slow` or `doctest skip`: {unmarked}"
    for doc in DOCS:
        assert any(b.mark == "default" for b in _blocks(doc)), f"{doc} has no runnable block"


@pytest.mark.parametrize("doc", DOCS)
def test_doc_commands_run(doc: str, tmp_path: Path) -> None:
    _run([b for b in _blocks(doc) if b.mark == "default"], tmp_path, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("block", _marked("slow"), ids=lambda b: f"{b.label}-{'-'.join(b.text.split()[:2])}")
def test_slow_doc_commands_run(block: Block, tmp_path: Path) -> None:
    _run([block], tmp_path, timeout_s=7200)


def test_a_wrong_example_fails(tmp_path: Path) -> None:
    # the runner itself must be able to fail: a command that exits 2 stops the script
    text = "kvresume session list --bogus\ntrue\n"
    wrong = Block(doc="example", line=1, lang="sh", mark="default", text=text)
    with pytest.raises(AssertionError, match="unrecognized arguments: --bogus"):
        _run([wrong], tmp_path, timeout_s=60)


def test_quiet_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = _quiet_ports(5)
    assert len(set(ports)) == 5 and all(10000 <= p < max(10001, _ephemeral_floor()) for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
