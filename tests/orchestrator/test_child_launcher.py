"""Children forked from a launcher (orchestrator/child_launcher.py) against children started with
`python -m`: the same module run as `__main__` with the same argv, working directory, environment and
pipes; exit codes (a signal's negative), kill, the stdin lifeline, stderr, a launcher per environment,
a request without the launcher's key refused, a launcher gone before its child, and the fallback to
`python -m` where no launcher starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import child_launcher
from orchestrator.child_launcher import LaunchedChild, LauncherError, launch
from orchestrator.child_process import ChildProcess
from tests.processes import children_of, cmdline_of, descendants_of, parent_of, process_alive

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.orchestrator.launched_child"
pytestmark = pytest.mark.skipif(not hasattr(socket, "send_fds"), reason="no descriptor passing here")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["LAUNCHED_CHILD_VARS"] = "CHILD_A,PYTEST_CURRENT_TEST"
    env.update(extra)
    return env


def _launched(command: str, **extra: str) -> tuple[LaunchedChild, dict[str, Any]]:
    child = launch(sys.executable, MODULE, cwd=REPO, env=_env(**extra), start_timeout_s=60)
    child.stdin.write(command.encode() + b"\n")
    child.stdin.flush()
    return child, json.loads(child.stdout.readline())


def _executed(command: str, **extra: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    child = subprocess.Popen(
        [sys.executable, "-m", MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
        env=_env(**extra),
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(command.encode() + b"\n")
    child.stdin.flush()
    return child, json.loads(child.stdout.readline())


def test_a_launched_child_runs_the_module_as_python_m_runs_it() -> None:
    for command, code in (("exit 0", 0), ("exit 7", 7), ("raise", 1)):
        forked, seen_forked = _launched(command, CHILD_A="x y")
        executed, seen_executed = _executed(command, CHILD_A="x y")
        assert forked.wait(timeout=30) == executed.wait(timeout=30) == code
        assert seen_forked.pop("pid") != seen_executed.pop("pid")
        assert seen_forked == seen_executed
        assert seen_forked["name"] == "__main__" and seen_forked["argv"] == []
        assert seen_forked["cwd"] == str(REPO) and seen_forked["vars"]["CHILD_A"] == "x y"


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="needs 2 CPUs")
def test_a_launched_child_takes_the_cpus_nice_and_umask_of_the_thread_that_starts_it() -> None:
    """What `python -m` from that thread would inherit, though the launcher started with other values (the
    first start below starts it, before the starting thread changes them)."""
    first, seen_first = _launched("exit 0", CHILD_A="inherit test")
    assert first.wait(timeout=30) == 0
    cpus = sorted(os.sched_getaffinity(0))
    results: dict[str, Any] = {}

    def start_from_a_changed_thread() -> None:
        me = threading.get_native_id()
        os.sched_setaffinity(0, cpus[-1:])  # this thread only
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + 3)
        old_umask = os.umask(0o027)
        try:
            for name, start in (("forked", _launched), ("executed", _executed)):
                child, seen = start("exit 0", CHILD_A="inherit test")
                assert child.wait(timeout=30) == 0
                results[name] = seen
        finally:
            os.umask(old_umask)

    worker = threading.Thread(target=start_from_a_changed_thread)
    worker.start()
    worker.join(timeout=120)
    forked, executed = results["forked"], results["executed"]
    assert forked["cpus"] == executed["cpus"] == cpus[-1:] != seen_first["cpus"]
    assert forked["nice"] == executed["nice"] == seen_first["nice"] + 3
    assert forked["umask"] == executed["umask"] == 0o027


def test_poll_wait_and_kill_as_popen_has_them() -> None:
    child, _ = _launched("wait")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert child.returncode == -signal.SIGKILL and child.poll() == -signal.SIGKILL
    child.kill()  # a second kill of an ended child does nothing


def test_poll_does_not_wait_for_a_thread_that_waits() -> None:
    child, _ = _launched("wait")
    waiter = threading.Thread(target=child.wait)
    waiter.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert child.poll() is None and time.monotonic() - started < 1.0
    child.stdin.close()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and child.poll() == 0


def test_a_launched_child_ends_when_its_stdin_closes() -> None:
    child, seen = _launched("wait")
    assert process_alive(seen["pid"])
    child.stdin.close()
    assert child.wait(timeout=30) == 0


def test_a_launched_childs_stderr_is_the_parents_at_its_start(capfd: pytest.CaptureFixture[str]) -> None:
    child, _ = _launched("stderr from the child")
    assert child.wait(timeout=30) == 0
    assert "from the child" in capfd.readouterr().err


def test_a_launcher_serves_one_environment_and_volatile_variables_follow_each_start() -> None:
    pids = set()
    for value in ("one", "two", "one"):
        child, seen = _launched("wait", CHILD_A=value, PYTEST_CURRENT_TEST=f"test {value} {time.time()}")
        pids.add(parent_of(seen["pid"]))
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        assert seen["vars"]["CHILD_A"] == value
        assert seen["vars"]["PYTEST_CURRENT_TEST"].startswith(f"test {value}")
    assert len(pids) == 2 and -1 not in pids, "a launcher per environment, whatever PYTEST_CURRENT_TEST says"


def test_a_request_without_the_launchers_key_forks_nothing() -> None:
    child, seen = _launched("wait", CHILD_A="key test")
    launcher_pid = parent_of(seen["pid"])
    launcher = next(
        la
        for la in child_launcher._LAUNCHERS._by_key.values()
        if la.proc.pid == launcher_pid  # noqa: SLF001
    )
    before = set(children_of(launcher_pid))
    r, w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(launcher.address)
            payload = json.dumps({"key": "00" * 32, "env": {}}).encode()
            socket.send_fds(sock, [len(payload).to_bytes(4, "big") + payload], [r, w, 2])
            assert sock.recv(64) == b"", "the launcher answered a request without its key"
    finally:
        os.close(r)
        os.close(w)
    assert set(children_of(launcher_pid)) == before
    child.stdin.close()
    assert child.wait(timeout=30) == 0


def test_a_child_outlives_its_launcher_and_then_reads_as_ended() -> None:
    child, seen = _launched("wait", CHILD_A="orphan test")
    launcher_pid = parent_of(seen["pid"])
    os.kill(launcher_pid, signal.SIGKILL)
    time.sleep(0.2)
    assert process_alive(seen["pid"]) and child.poll() is None
    child.stdin.close()
    assert child.wait(timeout=30) == 255  # its status went with the launcher


def test_the_next_start_after_a_launcher_died_gets_a_new_one() -> None:
    _, seen = _launched("exit 0", CHILD_A="restart test")
    os.kill(parent_of(seen["pid"]), signal.SIGKILL)
    time.sleep(0.2)
    child, seen_again = _launched("exit 0", CHILD_A="restart test")
    assert child.wait(timeout=30) == 0 and seen_again["vars"]["CHILD_A"] == "restart test"


@dataclasses.dataclass(frozen=True)
class _Config:
    authkey: bytes = b"k" * 32


def test_a_launcher_that_cannot_start_is_an_error_and_child_process_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a module whose import starts a thread: forking it would copy a process mid-work, so no launcher
    package = tmp_path / "threaded_child"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import threading, time, sys\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "if __name__ == '__main__':\n"
        "    sys.stdin.readline(); print('ready nowhere', flush=True); sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with pytest.raises(LauncherError, match="did not start"):
        launch(sys.executable, "threaded_child", cwd=REPO, env=env, start_timeout_s=60)
    with pytest.raises(LauncherError, match="failed before"):  # not tried again for this environment
        launch(sys.executable, "threaded_child", cwd=REPO, env=env, start_timeout_s=60)

    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    proc = ChildProcess(
        "threaded_child", _Config(), connections=1, python=sys.executable, start_timeout_s=60,
        error=RuntimeError, what="the threaded child",
    )  # fmt: skip
    try:
        assert isinstance(proc.proc, subprocess.Popen) and proc.address == "nowhere"
    finally:
        proc.kill()
    with pytest.raises(ValueError, match="start='fork'"):
        ChildProcess(
            "threaded_child", _Config(), connections=1, python=sys.executable, start_timeout_s=60,
            error=RuntimeError, what="x", start="fork",
        )  # fmt: skip


def test_the_launcher_ends_with_its_parent(tmp_path: Path) -> None:
    script = (
        "import os, sys, json\n"
        "from orchestrator.child_launcher import launch\n"
        f"env = dict(os.environ, LAUNCHED_CHILD_VARS='')\n"
        f"child = launch(sys.executable, {MODULE!r}, cwd=__import__('pathlib').Path('.'), env=env,"
        " start_timeout_s=60)\n"
        "child.stdin.write(b'wait\\n'); child.stdin.flush()\n"
        "print(json.loads(child.stdout.readline())['pid'], flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        launcher = parent_of(child)
        assert launcher not in (-1, parent.pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (process_alive(child) or process_alive(launcher)):
            time.sleep(0.05)
        assert not process_alive(child) and not process_alive(launcher)
    finally:
        parent.kill()


def test_serve_stopped_leaves_no_launcher_or_helper_running(tmp_path: Path) -> None:
    """`kvresume serve` with its model process forked from a launcher: after SIGTERM, the server, the
    launcher and the model process have all ended."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "serve",
            "--insecure-dev",
            "--data-dir",
            str(tmp_path),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--models",
            "a=random:v41-tiny@1",
            "--json",
            str(tmp_path / "ready.json"),
        ],  # fmt: skip
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "wb"),  # noqa: SIM115 - the child owns it
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        helpers = descendants_of(proc.pid)
        cmdlines = [cmdline_of(pid) for pid in helpers]
        assert any("orchestrator.child_launcher" in c for c in cmdlines), cmdlines  # the model process's
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(process_alive(pid) for pid in helpers):
            time.sleep(0.1)
        assert not [pid for pid in helpers if process_alive(pid)], "a helper outlived the server"
    finally:
        proc.kill()
