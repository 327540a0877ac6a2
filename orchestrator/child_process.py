"""A helper process of the service (`python -m <module>`) reached over authenticated AF_UNIX connections:
the model process (model_process/) and the registry writer (registry_writer/) both run this way.

Start-up: the parent writes one line to the child's stdin, the hex of a pickled config that carries the
connections' `authkey`, and keeps stdin open: its end (the parent exited, or was killed) ends the child
at once (`lifeline`), so no orphan keeps running. The child answers with one stdout line, `ready <socket
path>`, and then accepts connections on that socket, one thread per connection (`serve_connections`).
The parent keeps up to `connections` of them and gives each to one call at a time (`ChildProcess`).
Messages are pickles (protocol 5) sent with `send_bytes` / `recv_bytes`.

The child is `python -m <module>`: by default forked from a launcher that has already imported it
(child_launcher.py; the start then skips the imports, torch's among them), else executed afresh.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import structlog

from orchestrator.child_launcher import CHILD_STARTS, LaunchedChild, LauncherError, launch

__all__ = [
    "ChildProcess",
    "Reply",
    "dumps",
    "lifeline",
    "loads",
    "pack_error",
    "read_config",
    "serve_calls",
    "serve_connections",
]

log = structlog.get_logger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = 5


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


@dataclass(frozen=True, slots=True)
class Reply:
    """One call's answer: `value` when `error` is None."""

    value: Any = None
    error: BaseException | None = None


def pack_error(exc: BaseException, where: str) -> BaseException:
    """`exc` when it survives a pickle round trip (ValueError, PreconditionError, ...), else a
    RuntimeError that names it and `where` it was raised ("model process")."""
    try:
        loads(dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to cross means: send a plain description
        return RuntimeError(f"{where}: {type(exc).__name__}: {exc}")
    return exc


class ChildProcess:
    """One child process and its connections.

    Args:
        module: what `python -m` runs.
        config: pickled to the child's stdin; has `authkey` (bytes), the connections' key.
        connections: most connections at once (each serves one call at a time).
        error: the exception class raised when the child cannot start, cannot be reached or ended.
        what: the child's name in those errors ("the model process").
        start: "preloaded" (forked from this process's launcher of `module`, child_launcher.py, which
            has its imports done; `python -m` where no launcher can be had) or "exec" (`python -m`).

    Raises:
        error: the child did not print its ready line within `start_timeout_s`.
    """

    def __init__(
        self,
        module: str,
        config: Any,
        *,
        connections: int,
        python: str,
        start_timeout_s: float,
        error: type[Exception],
        what: str,
        start: str = "preloaded",
    ) -> None:
        if start not in CHILD_STARTS:
            raise ValueError(f"start={start!r} must be one of {', '.join(CHILD_STARTS)}")
        self.dead = False
        self._authkey: bytes = config.authkey
        self._max = connections
        self._made = 0
        self._error = error
        self._what = what
        # None: the process is dead (put by `kill`, so that waiting callers wake)
        self._idle: queue.LifoQueue[Connection | None] = queue.LifoQueue()
        self._lock = threading.Lock()
        self.proc = _start(module, python, start, start_timeout_s)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(dumps(config).hex().encode() + b"\n")
        self.proc.stdin.flush()
        ready: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=lambda: ready.put(self.proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
        try:
            line = ready.get(timeout=start_timeout_s).decode(errors="replace").strip()
        except queue.Empty:
            line = ""
        if not line.startswith("ready "):
            self.kill()
            raise error(
                f"{what} did not start (exit code {self.proc.poll()}, said {line[:200]!r}); "
                "its stderr is this process's"
            )
        self.address = line.removeprefix("ready ")

    def ended(self) -> Exception:
        return self._error(f"{self._what} ended")

    def checkout(self) -> Connection:
        """An idle connection, a new one while fewer than `connections` exist, else the next one given
        back. Raises `error` once the process is dead (waiters are woken by `kill`)."""
        if self.dead:
            raise self.ended()
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                make = self._made < self._max
                if make:
                    self._made += 1
            if make:
                try:
                    return Client(self.address, family="AF_UNIX", authkey=self._authkey)
                except (OSError, EOFError) as exc:
                    with self._lock:
                        self._made -= 1
                    raise self._error(f"cannot reach {self._what}: {exc}") from exc
            conn = self._idle.get()
        if conn is None:  # kill's wake-up: pass it on to the next waiter
            self._idle.put(None)
            raise self.ended()
        return conn

    def checkin(self, conn: Connection) -> None:
        self._idle.put(conn)

    def kill(self) -> None:
        self.dead = True
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # the child's lifeline: it exits on its own
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                break
            if conn is not None:
                conn.close()
        self._idle.put(None)


def _start(module: str, python: str, start: str, timeout_s: float) -> subprocess.Popen[bytes] | LaunchedChild:
    """`python -m <module>` with pipes for stdin and stdout, forked from a launcher when `start` is
    "preloaded" and one can be had, else executed."""
    env = os.environ.copy()
    if start == "preloaded":
        try:
            return launch(python, module, cwd=_REPO_ROOT, env=env, start_timeout_s=timeout_s)
        except LauncherError as exc:
            log.warning("child_launcher_unavailable", module=module, error=str(exc))
    return subprocess.Popen(
        [python, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=_REPO_ROOT, env=env
    )


# -- the child's side -------------------------------------------------------------------------------------


def read_config() -> Any:
    """The config line the parent wrote to stdin."""
    return loads(bytes.fromhex(sys.stdin.buffer.readline().decode().strip()))


def lifeline(name: str) -> None:
    """End this process as soon as its parent closes stdin (it exited, or was killed)."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        finally:
            os._exit(0)

    threading.Thread(target=watch, name=name, daemon=True).start()


def serve_calls(conn: Connection, call: Callable[[Any], Any], where: str) -> None:
    """Answer the calls on `conn` until the parent closes it: each request is unpickled and given to
    `call`, and its value, or the error it raised (`pack_error`), goes back as one `Reply`."""
    with conn:
        while True:
            try:
                request = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the parent closed this connection
            try:
                reply = Reply(value=call(loads(request)))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
                reply = Reply(error=pack_error(exc, where))
            try:
                conn.send_bytes(dumps(reply))
            except (EOFError, OSError):
                return


def serve_connections(authkey: bytes, serve: Callable[[Connection], None], name: str) -> None:
    """Print the ready line and serve each accepted connection in a thread of its own, for ever.

    After the ready line this process's stdout is its stderr (the parent's): the parent reads only that
    one line from the pipe, so anything printed there later (a log line) would fill it and then block.
    """
    listener = Listener(family="AF_UNIX", authkey=authkey)
    print(f"ready {listener.address}", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    while True:
        try:
            conn = listener.accept()
        except Exception:  # noqa: BLE001 - a client that failed authentication, or went away at once
            continue
        threading.Thread(target=serve, args=(conn,), name=name, daemon=True).start()
