"""Helper processes forked from a launcher that has already imported them: the model process and the
registry writer start without paying their imports again (torch alone takes about 1.5 s of a model
process's 2.1 s to its ready line on the 2-vCPU VMs), as CPython's `forkserver` start method does with its
preload. Used by `ChildProcess` (child_process.py) with `child_start = "preloaded"` (the default); "exec"
starts every child with `python -m <module>`, as before.

The launcher (`python -m orchestrator.child_launcher <module>`) imports `<module>.__main__` once, prints
`ready <socket path>` and then, for each request on that AF_UNIX socket (in a directory only this user can
enter, and carrying the key the parent wrote to the launcher's stdin), forks a child. The request passes
the child's stdin, stdout and stderr as file descriptors (SCM_RIGHTS) and the parent's environment at
that moment, with what a child of the requesting thread would inherit and the launcher's fork would not
(that thread's CPU affinity and nice value, the umask); the child puts them in place and runs `<module>`
as `__main__`, exactly what `python -m` would have run, on the same interpreter, working directory and
sys.path. (Resource limits and ignored signals are the launcher's, from its start.) So the child's side of
child_process.py (the config line on stdin, the stdin lifeline, the ready line) does not change.

Why a child forked here computes as one started fresh would: a launcher serves one environment only (the
parent's at the launcher's start, less `VOLATILE_ENV`), because what torch, MKL and OpenMP read at import
(ATEN_CPU_CAPABILITY, MKL_CBWR, OMP_NUM_THREADS, ...) cannot change afterwards; another environment gets a
launcher of its own. A launcher runs no thread and no torch op (so no thread pool exists when it forks),
and refuses to start if its imports started a thread. The model process's fingerprint check
(model_process/) still refuses a process that would compute differently.

The launcher reaps its children and reports each exit status to the parent on the request's socket;
`LaunchedChild` is the parent's handle, with the parts of `subprocess.Popen` that ChildProcess uses. The
launcher ends when the parent closes its stdin (the parent exited or was killed) and its last child has
exited; the children end on their own lifelines as before.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHILD_STARTS", "VOLATILE_ENV", "LaunchedChild", "LauncherError", "launch"]

# How a helper starts (`Settings.child_start`): forked from a launcher that has its imports done, or
# `python -m`
CHILD_STARTS = ("preloaded", "exec")
# Variables that change while a process runs and that no import reads: not part of a launcher's key (the
# child still gets their values at its request). pytest sets PYTEST_CURRENT_TEST at every test phase.
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
# Launchers kept per parent process; the least recently used one beyond it is closed (each holds its
# imports' memory, about 250 MB for the model process's).
MAX_LAUNCHERS = 3
_REQUEST_LIMIT = 1 << 22  # bytes of one request (the environment as JSON)
_SOCKET_NAME = "launcher.sock"


class LauncherError(RuntimeError):
    """A launcher could not start or could not fork a child; the caller starts the child with `python -m`
    instead."""


# -- the parent's side ------------------------------------------------------------------------------------


class LaunchedChild:
    """A child forked by a launcher: `pid`, `stdin` and `stdout` (this process's ends of the child's
    pipes), `returncode`, `poll`, `wait`, `kill`, as `subprocess.Popen` has them. The exit status comes from
    the launcher (which reaped it); a negative code is the signal that ended it. If the launcher is gone
    before the child, the status reads 255 once the child has gone."""

    def __init__(self, sock: socket.socket, pid: int, stdin: Any, stdout: Any, status: bytes = b"") -> None:
        """`status`: what the launcher sent after the pid line (its exit line, when it ended at once)."""
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._sock = sock
        self._buffer = status
        self._lock = threading.Lock()
        # a handle on this very process (not on whatever later reuses its pid), where Linux has them
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def poll(self) -> int | None:
        """The exit code, or None while it runs (or while another thread waits for it: never blocks)."""
        return self._await(0.0, blocking=False)

    def wait(self, timeout: float | None = None) -> int:
        code = self._await(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"launched child {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        if self.poll() is not None:
            return
        pidfd = self._pidfd
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            elif self.returncode is None:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass  # it ended meanwhile (and its handle may be closed by now)

    def _await(self, timeout: float | None, *, blocking: bool = True) -> int | None:
        """The exit code once known, waiting up to `timeout` seconds (None: for ever) for it; without
        `blocking`, None at once when another thread is waiting."""
        if not self._lock.acquire(blocking=blocking):
            return self.returncode
        try:
            if self.returncode is not None:
                return self.returncode
            deadline = None if timeout is None else time.monotonic() + timeout
            while b"\n" not in self._buffer:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._sock.settimeout(left)
                try:
                    data = self._sock.recv(256)
                except (TimeoutError, BlockingIOError):
                    return None
                except OSError:
                    data = b""
                if not data:
                    return self._launcher_gone(left)
                self._buffer += data
            line = self._buffer.split(b"\n", 1)[0].decode()
            if not line.startswith("exit "):
                raise LauncherError(f"the launcher said {line[:100]!r} about child {self.pid}")
            self._set(int(line.removeprefix("exit ")))
            return self.returncode
        finally:
            self._lock.release()

    def _launcher_gone(self, timeout: float | None) -> int | None:
        """The launcher ended before reporting: the child is gone once its pidfd reads (or its pid does
        not exist, without pidfds); its status is lost (255)."""
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], timeout)
            if not readable:
                return None
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            while _pid_exists(self.pid):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                time.sleep(0.01)
        self._set(255)
        return self.returncode

    def _set(self, code: int) -> None:
        self.returncode = code
        self._sock.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if self.returncode is None:
            self._sock.close()
            if self._pidfd is not None:
                os.close(self._pidfd)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it exists, as another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _Launcher:
    """One launcher process (`python -m orchestrator.child_launcher <module>`) and how to reach it."""

    def __init__(self, python: str, module: str, cwd: Path, env: Mapping[str, str], start_timeout_s: float):
        self.key = os.urandom(32)
        self.proc = subprocess.Popen(
            [python, "-m", "orchestrator.child_launcher", module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd, env=dict(env),
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(self.key.hex().encode() + b"\n")
        self.proc.stdin.flush()
        line = _read_line(self.proc.stdout, start_timeout_s)
        if not line.startswith("ready "):
            self.close()
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            raise LauncherError(f"launcher of {module} did not start (exit code {code}, said {line[:200]!r})")
        self.address = line.removeprefix("ready ")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, env: Mapping[str, str]) -> LaunchedChild:
        """Fork a child with `env`; its stdin and stdout are new pipes, its stderr this process's."""
        child_in, parent_in = os.pipe()
        parent_out, child_out = os.pipe()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(30.0)
            sock.connect(self.address)
            request = {"key": self.key.hex(), "env": dict(env), "inherit": _inherited_here()}
            payload = json.dumps(request).encode()
            header = len(payload).to_bytes(4, "big")
            socket.send_fds(sock, [header + payload], [child_in, child_out, 2])  # fd 2, as Popen leaves it
            reply = b""
            while b"\n" not in reply:
                data = sock.recv(256)
                if not data:
                    raise LauncherError("it closed the request without forking")
                reply += data
            line, _, status = reply.partition(b"\n")
            if not line.startswith(b"pid "):
                raise LauncherError(f"it said {line[:100]!r}")
        except (OSError, LauncherError) as exc:
            sock.close()
            os.close(parent_in)
            os.close(parent_out)
            raise LauncherError(f"launcher at {self.address}: {exc}") from exc
        finally:
            os.close(child_in)
            os.close(child_out)
        pid = int(line.removeprefix(b"pid "))
        return LaunchedChild(sock, pid, os.fdopen(parent_in, "wb"), os.fdopen(parent_out, "rb"), status)

    def close(self) -> None:
        """Close its stdin: it ends once its children have."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass


def _inherited_here() -> dict[str, Any]:
    """What a child started from this thread with `python -m` would inherit and a fork from the launcher
    would not (the launcher has its own, from its start): this thread's CPU affinity and nice value (both
    per thread on Linux) and the process's umask. The service pins itself to its CPUs after its first
    launcher may have started (`kvresume serve`, the benchmarks), and a helper started later must get the
    CPUs it would have got (measured: a registry writer forked with the launcher's two CPUs shared the
    model process's CPU and its busy share of the 64-session load fell from 0.95 to 0.84)."""
    inherit: dict[str, Any] = {}
    if hasattr(os, "sched_getaffinity"):
        inherit["cpus"] = sorted(os.sched_getaffinity(0))
    if hasattr(os, "getpriority"):
        inherit["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    umask = _umask()
    if umask is not None:
        inherit["umask"] = umask
    return inherit


def _umask() -> int | None:
    """The process's umask, read without setting it (Linux 4.7+), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _read_line(stream: Any, timeout_s: float) -> str:
    """One line of `stream`, or "" if none came within `timeout_s`."""
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0].decode(errors="replace").strip() if box else ""


class _Launchers:
    """This process's launchers by (interpreter, module, working directory, environment less
    `VOLATILE_ENV`): one process-wide set, as the imports they hold are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: collections.OrderedDict[tuple[Any, ...], _Launcher] = collections.OrderedDict()
        self._failed: set[tuple[Any, ...]] = set()

    def spawn(
        self, python: str, module: str, cwd: Path, env: Mapping[str, str], start_timeout_s: float
    ) -> LaunchedChild:
        key = (python, module, str(cwd), frozenset((k, v) for k, v in env.items() if k not in VOLATILE_ENV))
        with self._lock:
            if key in self._failed:
                raise LauncherError(f"the launcher of {module} for this environment failed before")
            launcher = self._by_key.get(key)
            if launcher is None or not launcher.alive():
                try:
                    launcher = _Launcher(python, module, cwd, env, start_timeout_s)
                except (OSError, LauncherError) as exc:
                    # once per environment: a launcher that cannot start would cost every start its wait
                    self._failed.add(key)
                    raise LauncherError(str(exc)) from exc
                self._by_key[key] = launcher
                while len(self._by_key) > MAX_LAUNCHERS:
                    self._by_key.popitem(last=False)[1].close()
            self._by_key.move_to_end(key)
        try:
            return launcher.spawn(env)
        except LauncherError:
            with self._lock:
                if self._by_key.get(key) is launcher:
                    del self._by_key[key]
            launcher.close()
            raise


_LAUNCHERS = _Launchers()  # process-wide: one set of launchers per process, like its imports


def launch(
    python: str, module: str, *, cwd: Path, env: Mapping[str, str], start_timeout_s: float
) -> LaunchedChild:
    """Fork `python -m <module>` from this process's launcher of `module` for `env` (started on first
    use); its stdin and stdout are pipes, its stderr this process's.

    Raises:
        LauncherError: no launcher could start or fork it (the caller falls back to `python -m`).
    """
    if not hasattr(socket, "send_fds") or not hasattr(os, "fork"):
        raise LauncherError("this platform cannot pass file descriptors to a forking launcher")
    return _LAUNCHERS.spawn(python, module, cwd, env, start_timeout_s)


# -- the launcher's side ----------------------------------------------------------------------------------


def _thread_count() -> int:
    """This process's threads, native ones included (Linux), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


@dataclass(slots=True)
class _Child:
    """A forked child as its launcher keeps it: the request's socket (its exit line goes there) and, where
    the kernel has them, a pidfd that becomes readable when it ends."""

    conn: socket.socket
    pidfd: int | None


class _LauncherLoop:
    """The launcher's one thread: accept requests, fork their children, reap them and report how each
    ended, until the parent closes stdin and the last child has ended."""

    def __init__(self, module: str, key: bytes, directory: Path) -> None:
        self.module = module
        self.key = key
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(directory / _SOCKET_NAME))
        self.listener.listen(16)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(0, selectors.EVENT_READ, "lifeline")
        self.children: dict[int, _Child] = {}
        self.accepting = True

    def run(self) -> None:
        while self.accepting or self.children:
            # without a pidfd for every child, look for ended ones every 50 ms
            polling = any(child.pidfd is None for child in self.children.values())
            for event, _ in self.selector.select(timeout=0.05 if polling else None):
                if event.data == "lifeline":
                    if not os.read(0, 1 << 16):  # the parent closed it, or ended
                        self.accepting = False
                        self.selector.unregister(0)
                        self.selector.unregister(self.listener)
                        self.listener.close()
                elif event.data == "accept" and self.accepting:
                    self._fork(self.listener.accept()[0])
            self._reap()

    def _fork(self, conn: socket.socket) -> None:
        """Read one request from `conn` and fork its child, or refuse it (closing `conn`)."""
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while len(data) >= 4 and len(data) < 4 + int.from_bytes(data[:4], "big") <= _REQUEST_LIMIT:
                more = conn.recv(1 << 16)
                if not more:
                    break
                data += more
            request = json.loads(data[4:].decode())
            if len(fds) != 3 or not isinstance(request, dict) or request.get("key") != self.key.hex():
                raise ValueError("a request without the launcher's key and three descriptors")
            env, inherit = request["env"], request.get("inherit", {})
            if not isinstance(env, dict) or not all(isinstance(x, str) for item in env.items() for x in item):
                raise ValueError("a request whose environment is not text")
            if not isinstance(inherit, dict):
                raise ValueError("a request whose inherited attributes are not a mapping")
            pid = os.fork()  # OSError, out of processes or memory: the parent starts it with `python -m`
        except (OSError, ValueError) as exc:
            print(f"launcher: refused a request: {exc}", file=sys.stderr)
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        if pid == 0:
            _become_child(self.module, env, inherit, fds, lambda: self._drop_in_child(conn))
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"pid {pid}\n".encode())
        except OSError:
            pass  # the parent went away; the child's lifeline ends it
        try:
            pidfd: int | None = os.pidfd_open(pid)
            self.selector.register(pidfd, selectors.EVENT_READ, "ended")
        except (AttributeError, OSError):
            pidfd = None
        self.children[pid] = _Child(conn, pidfd)

    def _drop_in_child(self, conn: socket.socket) -> None:
        """What a forked child must not keep of its launcher: the selector, the sockets (its own request's
        `conn` among them), the pidfds."""
        self.selector.close()
        self.listener.close()
        conn.close()
        for child in self.children.values():
            child.conn.close()
            if child.pidfd is not None:
                os.close(child.pidfd)

    def _reap(self) -> None:
        """Collect the children that ended and tell each one's parent its exit code."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            if child.pidfd is not None:
                self.selector.unregister(child.pidfd)
                os.close(child.pidfd)
            try:
                child.conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # its parent no longer asks
            child.conn.close()


def _serve(module: str, key: bytes) -> int:
    __import__(f"{module}.__main__")  # the imports every child would otherwise pay
    # not the module itself: each child runs it afresh as __main__ (runpy warns about a cached copy)
    del sys.modules[f"{module}.__main__"]
    if _thread_count() != 1:
        print(f"launcher: importing {module} started threads, which a fork cannot copy", file=sys.stderr)
        return 2
    directory = Path(tempfile.mkdtemp(prefix="kvresume-launcher-"))  # mode 0700: only this user enters
    try:
        loop = _LauncherLoop(module, key, directory)
        print(f"ready {directory / _SOCKET_NAME}", flush=True)
        loop.run()
    except KeyboardInterrupt:
        pass  # an interrupt of the whole process group: the children get it too
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def _become_child(
    module: str,
    env: Mapping[str, str],
    inherit: Mapping[str, Any],
    fds: list[int],
    drop_launcher: Callable[[], None],
) -> None:
    """In the forked child: drop what it holds of the launcher, take what the parent's thread would have
    passed on (`_inherited_here`), put the request's descriptors at 0, 1 and 2, take its environment, and
    run `module` as `python -m` runs it. Never returns."""
    code = 1
    try:
        drop_launcher()
        _take_inherited(inherit)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        # fresh stream objects over the new descriptors (the launcher's hold no data, but be sure)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.argv[0]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child reports what ended it, as an interpreter would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _take_inherited(inherit: Mapping[str, Any]) -> None:
    """Apply the parent thread's CPU affinity, nice value and umask to this (single-threaded) child. A nice
    value this process may not take (lower than its own, unprivileged) is left as it is."""
    if "cpus" in inherit:
        os.sched_setaffinity(0, inherit["cpus"])
    if "nice" in inherit and os.getpriority(os.PRIO_PROCESS, 0) != inherit["nice"]:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(inherit["nice"]))
        except PermissionError:
            pass
    if "umask" in inherit:
        os.umask(int(inherit["umask"]))


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m orchestrator.child_launcher <module>", file=sys.stderr)
        return 2
    key = bytes.fromhex(sys.stdin.buffer.readline().decode().strip())
    return _serve(sys.argv[1], key)


if __name__ == "__main__":
    sys.exit(main())
