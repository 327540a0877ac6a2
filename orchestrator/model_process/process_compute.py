"""`ProcessCompute`: the turn engine's model operations (`engine.ModelCompute`, plus the schedulers'
batched passes) run in the model process (`worker.py`), with each cache state held there and named here
by a `RemoteState` handle.

Same results as `TorchCompute` bit for bit: the model process loads the same models (the parent's specs,
device, kernels, cpu path and math, under the parent's numerics environment, which it inherits) and runs
the same calls; each model's fingerprint is checked against the parent's before the first call that uses
it, so a process that would compute differently is refused, not used. Tests compare the two on fresh
random turns.

Failure: when the model process dies (killed, out of memory), the calls in flight and any call naming one
of its states raise `ModelProcessError` (the turns fail; nothing they had stored is touched), and the
next call starts a new model process. When this process dies, the model process sees its stdin close and
exits.

Connections: up to `connections` at once (one per concurrent call: a scheduler step, a turn's import or
export), each served by a thread of its own in the model process.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from model import PassOutput
from orchestrator.api.errors import UnavailableError
from orchestrator.child_process import ChildProcess
from orchestrator.engine.model_compute import TurnEndExport
from orchestrator.engine.sampler import ChosenToken
from orchestrator.model_process.wire import Reply, WireOutput, dumps, loads, unpack_logits
from orchestrator.model_process.worker import WorkerConfig

__all__ = ["ModelProcessError", "ProcessCompute", "RemoteKept", "RemoteState"]

log = structlog.get_logger(__name__)


class ModelProcessError(UnavailableError, RuntimeError):
    """The model process died or could not start, or a state it held is gone with it. A turn that meets
    it fails before its commit; the next call starts a new model process, so callers see UNAVAILABLE with
    a retry hint."""

    default_retry_after_s = 1.0


class RemoteState:
    """A cache state held by the model process: its id there, the process generation it belongs to, and
    its length (kept current by every call that changes it). `clone()` copies it there.

    A full hit's prefix state (`ProcessCompute.restore_decoded`) starts out pending: `pending` holds
    what restores it (the model, the kept decoded KV, the history), and `state_id` is None until the
    first call that names it restores it there. Why: a full hit continues from a copy of it with the
    pooled windows (`clone_with_windows`), which a pending state gets in one round trip that restores
    straight into the copy, so the prefix itself is restored only when a turn uses it (a global-only
    replay): one round trip and one copy of the global KV less per full-hit turn."""

    __slots__ = ("_owner", "generation", "state_id", "n_tokens", "pending", "__weakref__")
    batch = 1

    def __init__(
        self,
        owner: ProcessCompute,
        generation: int,
        state_id: int | None,
        n_tokens: int,
        pending: _PendingRestore | None = None,
    ) -> None:
        self._owner = owner
        self.generation = generation
        self.state_id = state_id
        self.n_tokens = n_tokens
        self.pending = pending

    def clone(self) -> RemoteState:
        return self._owner.clone(self)

    def __repr__(self) -> str:
        return f"RemoteState(id={self.state_id}, generation={self.generation}, n_tokens={self.n_tokens})"


class RemoteKept:
    """Decoded global KV kept by the model process (`keep_decoded`): its id there, the process
    generation, and its history length and bytes. Freed there when dropped here; unusable (a miss, never
    an error) once that process ended."""

    __slots__ = ("_owner", "generation", "kept_id", "n_tokens", "nbytes", "__weakref__")

    def __init__(
        self, owner: ProcessCompute, generation: int, kept_id: int, n_tokens: int, nbytes: int
    ) -> None:
        self._owner = owner
        self.generation = generation
        self.kept_id = kept_id
        self.n_tokens = n_tokens
        self.nbytes = nbytes

    @property
    def usable(self) -> bool:
        return self._owner.running(self.generation)

    def __repr__(self) -> str:
        return f"RemoteKept(id={self.kept_id}, generation={self.generation}, n_tokens={self.n_tokens})"


@dataclass(frozen=True)
class _PendingRestore:
    """What restores a pending `RemoteState` there: `restore_decoded` of the served model, the kept KV
    and the history (the handle to the kept KV is held here, so it stays there until the restore)."""

    served: Any
    kept: RemoteKept
    tokens: tuple[int, ...]


class _Process(ChildProcess):
    """One model process and its connections (orchestrator/child_process.py), with its generation and the
    models whose fingerprint it was checked for."""

    def __init__(self, config: WorkerConfig, generation: int, connections: int, python: str,
                 start_timeout_s: float, child_start: str) -> None:  # fmt: skip
        self.generation = generation
        self.checked: set[str] = set()
        super().__init__(
            "orchestrator.model_process",
            config,
            connections=connections,
            python=python,
            start_timeout_s=start_timeout_s,
            error=ModelProcessError,
            what="the model process",
            start=child_start,
        )

    def ended(self) -> Exception:
        return ModelProcessError("the model process ended; its states are lost")


class ProcessCompute:
    """Model operations in a model process of their own (see the module docstring).

    Args:
        specs, device, kernel_backend, cpu_path, linear_math: the served models, as the parent's
            `ModelRegistry` has them (`from_registry` takes them from one).
        threads: torch intra-op threads of the model process.
        cpus: the CPUs the model process pins itself to (orchestrator/cpu_split.py); empty: none.
        connections: most calls in flight at once.
        start_timeout_s: how long a start may take (importing torch, loading the models).
        tune_gc: the model process tunes its garbage collector for serving once ready
            (orchestrator/heap.py).
        child_start: "preloaded" (forked from a launcher with its imports done) or "exec" (`python -m`):
            orchestrator/child_launcher.py.
    """

    def __init__(
        self,
        *,
        specs: Mapping[str, Any],
        device: str = "cpu",
        kernel_backend: str = "torch",
        cpu_path: str = "portable",
        linear_math: str = "exact",
        threads: int = 1,
        cpus: Collection[int] = (),
        connections: int = 8,
        python: str | None = None,
        start_timeout_s: float = 120.0,
        tune_gc: bool = True,
        child_start: str = "preloaded",
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections={connections} must be >= 1")
        self._config_args = dict(
            specs=dict(specs), device=device, kernel_backend=kernel_backend, cpu_path=cpu_path,
            linear_math=linear_math, threads=threads, cpus=tuple(sorted(cpus)), tune_gc=tune_gc,
        )  # fmt: skip
        self._connections = connections
        self._python = python or sys.executable
        self._start_timeout_s = start_timeout_s
        self._child_start = child_start
        self._proc: _Process | None = None
        self._generation = 0
        self._lock = threading.Lock()
        # one restore of a pending prefix state at a time (`_restore_pending`)
        self._restore_lock = threading.Lock()
        self._closed = False
        # (generation, state id) of handles gone here; sent with the next call
        self._freed: collections.deque[tuple[int, int]] = collections.deque()

    @classmethod
    def from_registry(
        cls, registry: Any, *, threads: int = 1, cpus: Collection[int] = (), connections: int = 8,
        tune_gc: bool = True, child_start: str = "preloaded",
    ) -> ProcessCompute:
        return cls(
            specs={name: registry.spec(name) for name in registry.names},
            device=registry.device,
            kernel_backend=registry.kernel_backend,
            cpu_path=registry.cpu_path,
            linear_math=registry.linear_math,
            threads=threads,
            cpus=cpus,
            connections=connections,
            tune_gc=tune_gc,
            child_start=child_start,
        )

    # -- process and calls ----------------------------------------------------------------------------

    def _process(self) -> _Process:
        with self._lock:
            if self._closed:
                raise ModelProcessError("the model process was closed")
            if self._proc is None or self._proc.dead:
                self._generation += 1
                self._freed.clear()
                config = WorkerConfig(authkey=os.urandom(32), **self._config_args)  # type: ignore[arg-type]
                self._proc = _Process(
                    config, self._generation, self._connections, self._python, self._start_timeout_s,
                    self._child_start,
                )
                log.info("model_process_started", pid=self._proc.proc.pid, generation=self._generation)
            return self._proc

    def _call(self, op: str, *args: Any, served: Any = None, states: Sequence[Any] = ()) -> Any:
        return self._call_at(op, *args, served=served, states=states)[0]

    def _call_at(
        self, op: str, *args: Any, served: Any = None, states: Sequence[Any] = ()
    ) -> tuple[Any, int]:
        """Run `op(*args)` there; its value and the generation of the process that ran it.

        `served`: the model the call uses (its fingerprint is checked once per model process);
        `states`: the handles named in `args`, which must belong to this very process.
        """
        return self._start_at(op, *args, served=served, states=states)()

    def _start_at(
        self, op: str, *args: Any, served: Any = None, states: Sequence[Any] = ()
    ) -> Callable[[], tuple[Any, int]]:
        """`_call_at` in two halves: this one sends the call; the function it returns waits for the
        answer (and must be called: it gives the connection back)."""
        proc = self._process()
        for state in states:
            if state is not None and state.generation != proc.generation:
                raise ModelProcessError(
                    f"state {state.state_id} was held by an earlier model process, which ended"
                )
        if served is not None and served.name not in proc.checked:
            theirs = self._send(proc, "fingerprint", (served.name,))
            if theirs != served.fingerprint:
                raise ModelProcessError(
                    f"model {served.name}: the model process computes under fingerprint "
                    f"{theirs.hex()[:16]}, this process under {served.fingerprint.hex()[:16]} "
                    "(numerics or weights differ)"
                )
            proc.checked.add(served.name)
        finish = self._start(proc, op, args)
        return lambda: (finish(), proc.generation)

    def _send(self, proc: _Process, op: str, args: tuple[Any, ...]) -> Any:
        return self._start(proc, op, args)()

    def _start(self, proc: _Process, op: str, args: tuple[Any, ...]) -> Callable[[], Any]:
        """Send `op(*args)` on a connection of its own; the function that waits for its value."""
        frees = []
        while self._freed:
            try:
                gen, sid = self._freed.popleft()
            except IndexError:
                break
            if gen == proc.generation:
                frees.append(sid)
        payload = dumps((op, args, frees))
        conn = proc.checkout()

        def lost(exc: BaseException) -> ModelProcessError:
            conn.close()
            self._died(proc, f"{type(exc).__name__}: {exc}")
            return ModelProcessError(
                f"the model process ended during {op} (exit code {proc.proc.poll()}); its states are lost"
            )

        try:
            conn.send_bytes(payload)
        except (EOFError, OSError) as exc:
            raise lost(exc) from exc

        def finish() -> Any:
            try:
                reply: Reply = loads(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise lost(exc) from exc
            proc.checkin(conn)
            if reply.error is not None:
                raise reply.error
            return reply.value

        return finish

    def _died(self, proc: _Process, why: str) -> None:
        with self._lock:
            if proc.dead:
                return
            log.error("model_process_died", pid=proc.proc.pid, generation=proc.generation, error=why)
            proc.kill()

    def running(self, generation: int) -> bool:
        """Whether the model process of `generation` is the one running now (its states still exist)."""
        proc = self._proc
        return proc is not None and not proc.dead and proc.generation == generation

    # -- states ---------------------------------------------------------------------------------------

    def _handle(self, state_id: int, n_tokens: int, generation: int) -> RemoteState:
        return self._freed_with(RemoteState(self, generation, state_id, n_tokens), generation, state_id)

    def _freed_with(self, handle: Any, generation: int, held_id: int) -> Any:
        """`handle`, whose drop here frees `held_id` there (sent with the next call to that process)."""
        weakref.finalize(handle, self._freed.append, (generation, held_id))
        return handle

    def _sid(self, state: RemoteState | None) -> int | None:
        """The id of `state` there (None: no state), restoring a pending state there first."""
        if state is None:
            return None
        if not isinstance(state, RemoteState):
            # every state of a node with a model process is made there (a model swap's mapped state by
            # `state_from_global`), so this is a wiring bug, not a turn's input
            raise TypeError(f"{type(state).__name__} is not a state of the model process")
        if state.pending is not None:
            self._restore_pending(state)
        assert state.state_id is not None
        return state.state_id

    def _restore_pending(self, state: RemoteState) -> None:
        """Restore a pending prefix state there (`restore_decoded`), once, whichever thread asks first."""
        with self._restore_lock:
            restore = state.pending
            if restore is None:
                return
            (sid, n), generation = self._call_at(
                "restore_decoded", restore.served.name, self._kid(restore.kept), list(restore.tokens),
                served=restore.served,
            )  # fmt: skip
            state.state_id, state.n_tokens, state.generation = sid, n, generation
            state.pending = None  # lets the kept KV go when nothing else holds it
            self._freed_with(state, generation, sid)

    def _output(self, wire: WireOutput, state: RemoteState | None, generation: int) -> PassOutput:
        if state is not None and wire.state_id == state.state_id:
            state.n_tokens = wire.n_tokens
            handle = state
        else:
            handle = self._handle(wire.state_id, wire.n_tokens, generation)
        # a greedy chain's pass carries only the logits' greedy choice (`start_decode_many`'s `logits`)
        logits = ChosenToken(wire.choice) if wire.choice is not None else unpack_logits(wire.logits)
        return PassOutput(logits=logits, state=handle, stats=wire.stats)  # type: ignore[arg-type]

    def clone(self, state: RemoteState) -> RemoteState:
        (sid, n), generation = self._call_at("clone", self._sid(state), states=(state,))
        return self._handle(sid, n, generation)

    def state_from_global(self, served: Any, tokens: Sequence[int], blobs: Sequence[bytes]) -> RemoteState:
        """`model.state_from_global` there: a batch-1 state holding the global KV of `tokens` from
        consecutive chunks, windows absent (a model swap's receiver state). Raises CacheFormatError."""
        (sid, n), generation = self._call_at(
            "state_from_global", served.name, list(tokens), list(blobs), served=served
        )
        return self._handle(sid, n, generation)

    def preload(self, served: Any) -> None:
        """Start the model process now (when it is not running) and load and check `served` there, so
        that no turn waits for either."""
        self._call("fingerprint", served.name, served=served)

    def held_states(self) -> int:
        """How many states the model process holds (tests: handles dropped here are freed there)."""
        return int(self._call("held"))

    def stats(self) -> dict[str, Any]:
        """The model process's own accounting (`worker._Worker.op_stats`)."""
        return self._call("stats")

    # -- engine.ModelCompute ---------------------------------------------------------------------------

    def new_state(self, served: Any) -> RemoteState:
        (sid, n), generation = self._call_at("new_state", served.name, served=served)
        return self._handle(sid, n, generation)

    def import_chunk(self, served: Any, state: RemoteState, blob: bytes) -> int:
        end, state.n_tokens = self._call(
            "import_chunk", served.name, self._sid(state), blob, served=served, states=(state,)
        )
        return int(end)

    def import_chunks(self, served: Any, state: RemoteState, blobs: Sequence[bytes]) -> tuple[int, Any]:
        done, error, state.n_tokens = self._call(
            "import_chunks", served.name, self._sid(state), list(blobs), served=served, states=(state,)
        )
        return done, error

    def seal_prefix(self, served: Any, state: RemoteState, tokens: Sequence[int]) -> None:
        state.n_tokens = self._call(
            "seal_prefix", served.name, self._sid(state), list(tokens), served=served, states=(state,)
        )

    def import_windows(self, served: Any, state: RemoteState, blob: bytes) -> None:
        state.n_tokens = self._call(
            "import_windows", served.name, self._sid(state), blob, served=served, states=(state,)
        )

    def export_global(self, served: Any, state: RemoteState, start: int, end: int) -> bytes:
        return self._call(
            "export_global", served.name, self._sid(state), start, end, served=served, states=(state,)
        )

    def export_windows(self, served: Any, state: RemoteState) -> bytes:
        return self._call("export_windows", served.name, self._sid(state), served=served, states=(state,))

    def prefill(
        self, served: Any, tokens: Sequence[int], state: RemoteState | None, *, prompt_end: int
    ) -> PassOutput:
        wire, generation = self._call_at(
            "prefill", served.name, list(tokens), self._sid(state), prompt_end, served=served, states=(state,)
        )
        return self._output(wire, state, generation)

    def decode(self, served: Any, token: int, state: RemoteState) -> PassOutput:
        wire, generation = self._call_at(
            "decode", served.name, int(token), self._sid(state), served=served, states=(state,)
        )
        return self._output(wire, state, generation)

    def decode_many(
        self, served: Any, tokens: Sequence[int], states: Sequence[RemoteState]
    ) -> list[PassOutput]:
        return self.start_decode_many(served, tokens, states)()

    def start_decode_many(
        self, served: Any, tokens: Sequence[int], states: Sequence[RemoteState],
        logits: Sequence[str] | None = None,
    ) -> Callable[[], list[PassOutput]]:
        """`decode_many` in two halves, as `start_prefill_many`: the batching loop hands the last step's
        prompts their first tokens while the model computes this pass. `logits`: what of each output's
        logits to bring back (`scheduler.work.LOGITS_WANTED`: the rows, only their greedy choice, which
        the output then holds as an `engine.sampler.ChosenToken`, or nothing; None: all the rows)."""
        sids = [self._sid(s) for s in states]
        wanted = None if logits is None else list(logits)
        finish = self._start_at(
            "decode_many", served.name, [int(t) for t in tokens], sids, wanted, served=served, states=states
        )

        def outputs() -> list[PassOutput]:
            wires, generation = finish()
            return [self._output(w, s, generation) for w, s in zip(wires.unpack(), states, strict=True)]

        return outputs

    def prefill_many(
        self,
        served: Any,
        chunks: Sequence[Sequence[int]],
        states: Sequence[RemoteState | None],
        prompt_ends: Sequence[int],
    ) -> list[PassOutput]:
        return self.start_prefill_many(served, chunks, states, prompt_ends)()

    def start_prefill_many(
        self,
        served: Any,
        chunks: Sequence[Sequence[int]],
        states: Sequence[RemoteState | None],
        prompt_ends: Sequence[int],
        logits: Sequence[str] | None = None,
    ) -> Callable[[], list[PassOutput]]:
        """`prefill_many` in two halves: this one sends the pass; the function it returns waits for its
        outputs (and must be called). The batching loop samples the step's decode chains meanwhile.
        `logits` as `start_decode_many`."""
        sids = [self._sid(s) for s in states]
        wanted = None if logits is None else list(logits)
        finish = self._start_at(
            "prefill_many", served.name, [list(c) for c in chunks], sids, list(prompt_ends), wanted,
            served=served, states=states,
        )  # fmt: skip

        def outputs() -> list[PassOutput]:
            wires, generation = finish()
            return [self._output(w, s, generation) for w, s in zip(wires.unpack(), states, strict=True)]

        return outputs

    # -- decoded global KV kept beside pool entries (engine/decoded_states.py) ----------------------------

    def keep_decoded(self, served: Any, state: RemoteState) -> RemoteKept | None:
        """Keep the state's decoded global KV in the model process (`TorchCompute.keep_decoded` there);
        a handle to it, or None when nothing was kept."""
        kept, generation = self._call_at(
            "keep_decoded", served.name, self._sid(state), served=served, states=(state,)
        )
        return self._kept_handle(kept, generation)

    def _kept_handle(self, kept: tuple[int | None, int, int], generation: int) -> RemoteKept | None:
        """The handle to what `op_keep_decoded` kept there, `(id, history length, bytes)` (None: nothing),
        freed there when dropped here."""
        kept_id, n_tokens, nbytes = kept
        if kept_id is None:
            return None
        return self._freed_with(RemoteKept(self, generation, kept_id, n_tokens, nbytes), generation, kept_id)

    def export_windows_keeping(
        self, served: Any, state: RemoteState, *, keep: bool
    ) -> tuple[bytes, RemoteKept | None]:
        """`export_windows` and, with `keep`, `keep_decoded` of the state in one round trip (a turn end's
        pool put needs both: one call less per turn for the model process to answer)."""
        sid = self._sid(state)
        (windows, kept), generation = self._call_at(
            "export_windows_keeping", served.name, sid, bool(keep), served=served, states=(state,)
        )
        return windows, self._kept_handle(kept, generation)

    def export_turn_end(
        self, served: Any, state: RemoteState, ranges: Sequence[tuple[int, int]], *, keep: bool
    ) -> TurnEndExport:
        """A persisted turn end's global-KV payloads of `ranges`, windows and kept decoded KV in one round
        trip (`export_global` per range and `export_windows_keeping` there)."""
        spans = [(int(start), int(end)) for start, end in ranges]
        sid = self._sid(state)
        (blobs, windows, kept), generation = self._call_at(
            "export_turn_end", served.name, sid, spans, bool(keep), served=served, states=(state,)
        )
        return TurnEndExport(
            global_blobs=dict(zip(spans, blobs, strict=True)),
            windows=windows,
            kept=self._kept_handle(kept, generation),
        )

    def _kid(self, kept: Any) -> int:
        """The id there of what `keep_decoded` kept, checked to be of the running model process."""
        if not isinstance(kept, RemoteKept):
            raise TypeError(f"{type(kept).__name__} was not kept by the model process")
        if not self.running(kept.generation):
            raise ModelProcessError(
                f"decoded state {kept.kept_id} was kept by an earlier model process, which ended"
            )
        return kept.kept_id

    def fill_decoded(self, served: Any, state: RemoteState, kept: Any) -> None:
        state.n_tokens = self._call(
            "fill_decoded", served.name, self._sid(state), self._kid(kept), served=served, states=(state,)
        )

    def restore_decoded(self, served: Any, kept: Any, tokens: Sequence[int]) -> RemoteState:
        """A full hit's prefix state: `new_state`, `fill_decoded` and `seal_prefix` there, in one call,
        made when a call first names the state (pending until then: `RemoteState`). The kept KV is
        checked now (a kept handle of another compute or of an ended process raises here, as before)."""
        self._kid(kept)
        tokens = tuple(int(t) for t in tokens)
        pending = _PendingRestore(served, kept, tokens)
        return RemoteState(self, kept.generation, None, len(tokens), pending=pending)

    def clone_with_windows(self, served: Any, state: RemoteState, blob: bytes) -> RemoteState:
        """`clone` and `import_windows` there in one call; a copy the windows do not fit is not kept.
        For a pending prefix state, the restore goes straight into the copy (`restore_with_windows`
        there) and the prefix stays pending. Raises CacheFormatError."""
        restore = state.pending if isinstance(state, RemoteState) else None
        if restore is not None:
            (sid, n), generation = self._call_at(
                "restore_with_windows", served.name, self._kid(restore.kept), list(restore.tokens), blob,
                served=served,
            )  # fmt: skip
            return self._handle(sid, n, generation)
        (sid, n), generation = self._call_at(
            "clone_with_windows", served.name, self._sid(state), blob, served=served, states=(state,)
        )
        return self._handle(sid, n, generation)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
