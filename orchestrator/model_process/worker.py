"""The model process: the served models, their cache states and every torch operation on them, in a
process of its own (`python -m orchestrator.model_process`), so that the model's many small ops do
not share one GIL with the service's Python (vLLM v1 runs its EngineCore apart from the API server for
the same reason).

Measured before it existed (AMD EPYC Zen 4, 2 cores, 64 sessions of v41-sib-s, in-process): the step
loop was busy 98% of the run's wall time but ran on the CPU only 67% of it; the rest it waited for the
GIL after each op while the turn threads ran (a GIL convoy), so steps took 1.5x their CPU time.

Start-up and connections as orchestrator/child_process.py has them (a config line on stdin, whose end
ends this process; a ready line; one thread per AF_UNIX connection). Each call on a connection is one
request `(op, args, frees)` and one `wire.Reply`; `frees` are ids of states the parent no longer holds.

States are kept by id; a forward pass updates its input state in place (model.PassOutput), so its output
keeps the input's id, and a pass that starts from nothing gets a new one.
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from orchestrator.child_process import serve_calls, serve_connections
from orchestrator.model_process.wire import WireOutput, WireOutputs, check_wanted, pack_logits

__all__ = ["WorkerConfig", "serve_forever"]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What the model process needs to load the same models under the same numerics as its parent."""

    specs: Mapping[str, Any]  # name -> orchestrator.engine.ServedModelSpec
    device: str
    kernel_backend: str
    cpu_path: str
    linear_math: str
    threads: int
    authkey: bytes
    # the CPUs this process pins itself to before torch loads (orchestrator/cpu_split.py); empty: none
    cpus: tuple[int, ...] = ()
    # tune the collector for serving once ready (orchestrator/heap.py): the start-up heap (torch, the
    # served models' specs) frozen, the youngest generation collected less often
    tune_gc: bool = True


@dataclass(frozen=True)
class _KeptTurnEnd:
    """What a turn end keeps (`op_export_windows_keeping`): the decoded global KV, which every use of the
    kept id fills from, and a snapshot of the whole state (`ModelState.clone`: its tensors shared, never
    written) with the windows bytes exported from it. A full hit that brings those very bytes for the
    snapshot's history continues from a copy of the snapshot (`op_restore_with_windows`) instead of
    filling a new state and importing the bytes: the same state (the import reads back what the export
    wrote, tested bit for bit), without the import's copies and dequantization (session 30)."""

    sources: Any  # engine.decoded_states.TensorSources
    snapshot: Any  # model.ModelState
    windows: bytes


class _Worker:
    def __init__(self, config: WorkerConfig) -> None:
        # torch only here, after the parent's numerics environment (inherited) is in force
        from model import configure_torch
        from orchestrator.engine.model_compute import TorchCompute
        from orchestrator.engine.served_models import ModelRegistry

        configure_torch(config.cpu_path, threads=config.threads)
        self.registry = ModelRegistry(
            config.specs,
            device=config.device,
            kernel_backend=config.kernel_backend,
            cpu_path=config.cpu_path,
            linear_math=config.linear_math,
        )
        self.compute = TorchCompute()
        # by id: the cache states, and the decoded global KV kept beside pool entries (`op_keep_decoded`)
        self._states: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # op -> [calls, thread CPU seconds, wall seconds] (`op_stats`: where the model process's time goes)
        self._op_times: dict[str, list[float]] = {}
        # objects of the start-up heap frozen out of the collector's reach (`serve_forever`; 0: none)
        self.frozen_objects = 0
        # full hits continued from a turn end's snapshot (`_KeptTurnEnd`), not filled and imported
        self.snapshot_restores = 0

    # -- the state table --------------------------------------------------------------------------------

    def _keep(self, state: Any) -> int:
        with self._lock:
            sid = next(self._ids)
            self._states[sid] = state
            return sid

    def _state(self, sid: int | None) -> Any:
        if sid is None:
            return None
        with self._lock:
            state = self._states.get(sid)
        if state is None:
            raise ValueError(f"model process: no state {sid} (freed, or kept by an earlier model process)")
        return state

    def free(self, sids: Sequence[int]) -> None:
        with self._lock:
            for sid in sids:
                self._states.pop(sid, None)

    def held(self) -> int:
        with self._lock:
            return len(self._states)

    def _served(self, model: str) -> Any:
        served = self.registry.get(model)  # loads outside the serving loop's inference mode (the registry)
        if served is None:
            raise ValueError(f"model process: model {model!r} is not served")
        return served

    def _output(self, out: Any, sid: int | None) -> WireOutput:
        sid = self._output_id(out, sid)
        return WireOutput(
            state_id=sid, n_tokens=out.state.n_tokens, logits=pack_logits(out.logits), stats=out.stats
        )

    def _output_id(self, out: Any, sid: int | None) -> int:
        # the pass updated its input state in place; one that started from nothing made a new state
        if sid is None or self._state(sid) is not out.state:
            sid = self._keep(out.state)
        return sid

    def _outputs(
        self, outs: Sequence[Any], sids: Sequence[int | None], logits: Sequence[str] | None = None
    ) -> WireOutputs:
        ids = [self._output_id(o, s) for o, s in zip(outs, sids, strict=True)]
        return WireOutputs.pack(list(outs), ids, logits)

    # -- operations (`op_<name>`), each one call ------------------------------------------------------

    def op_fingerprint(self, model: str) -> bytes:
        return self._served(model).fingerprint

    def op_held(self) -> int:
        return self.held()

    def op_stats(self) -> dict[str, Any]:
        """Calls, thread CPU and wall seconds per operation, the process's CPU seconds, the states held, the
        start-up objects frozen and the collector's thresholds (orchestrator/heap.py)."""
        with self._lock:
            ops = {op: tuple(v) for op, v in self._op_times.items()}
        t = os.times()
        return {"ops": ops, "process_cpu_s": t.user + t.system, "states": self.held(),
                "frozen_objects": self.frozen_objects, "gc_threshold": gc.get_threshold(),
                "snapshot_restores": self.snapshot_restores}  # fmt: skip

    def op_new_state(self, model: str) -> tuple[int, int]:
        state = self.compute.new_state(self._served(model))
        return self._keep(state), state.n_tokens

    def op_state_from_global(
        self, model: str, tokens: Sequence[int], blobs: Sequence[bytes]
    ) -> tuple[int, int]:
        import torch

        from model import state_from_global

        served = self._served(model)
        device = served.model.head.weight.device
        history = torch.tensor([list(tokens)], dtype=torch.int64, device=device)
        state = state_from_global(served.model, history, list(blobs), fingerprint=served.fingerprint)
        return self._keep(state), state.n_tokens

    def op_clone(self, sid: int) -> tuple[int, int]:
        state = self._state(sid).clone()
        return self._keep(state), state.n_tokens

    def op_import_chunk(self, model: str, sid: int, blob: bytes) -> tuple[int, int]:
        state = self._state(sid)
        end = self.compute.import_chunk(self._served(model), state, blob)
        return end, state.n_tokens

    def op_import_chunks(self, model: str, sid: int, blobs: Sequence[bytes]) -> tuple[int, Any, int]:
        state = self._state(sid)
        done, error = self.compute.import_chunks(self._served(model), state, blobs)
        return done, error, state.n_tokens

    def op_seal_prefix(self, model: str, sid: int, tokens: Sequence[int]) -> int:
        state = self._state(sid)
        self.compute.seal_prefix(self._served(model), state, tokens)
        return state.n_tokens

    def op_import_windows(self, model: str, sid: int, blob: bytes) -> int:
        state = self._state(sid)
        self.compute.import_windows(self._served(model), state, blob)
        return state.n_tokens

    def op_export_global(self, model: str, sid: int, start: int, end: int) -> bytes:
        return self.compute.export_global(self._served(model), self._state(sid), start, end)

    def op_export_windows(self, model: str, sid: int) -> bytes:
        return self.compute.export_windows(self._served(model), self._state(sid))

    def op_keep_decoded(self, model: str, sid: int) -> tuple[int | None, int, int]:
        """Keep the state's decoded global KV beside the states (same ids, freed the same way); its id
        (None: nothing kept), history length and bytes."""
        kept = self.compute.keep_decoded(self._served(model), self._state(sid))
        if kept is None:
            return None, 0, 0
        return self._keep(kept), kept.n_tokens, kept.nbytes

    def _sources(self, kept_id: int) -> Any:
        """The decoded global KV kept under `kept_id` (by `op_keep_decoded` or a turn end)."""
        kept = self._state(kept_id)
        return kept.sources if isinstance(kept, _KeptTurnEnd) else kept

    def op_export_windows_keeping(
        self, model: str, sid: int, keep: bool
    ) -> tuple[bytes, tuple[int | None, int, int]]:
        """`op_export_windows` and, with `keep`, `op_keep_decoded` of the same state in one call (what a
        turn end pools), with a snapshot of the state beside the decoded KV (`_KeptTurnEnd`; its bytes:
        the storages the snapshot pins, the decoded KV's among them, and the windows bytes kept)."""
        windows = self.op_export_windows(model, sid)
        if not keep:
            return windows, (None, 0, 0)
        from orchestrator.engine.decoded_states import held_bytes, state_tensors

        state = self._state(sid)
        kept = self.compute.keep_decoded(self._served(model), state)
        if kept is None:
            return windows, (None, 0, 0)
        # a state a chunked prefill left mid-prompt continues differently from a fresh one (its decoder
        # floor): only the decoded KV is kept of it
        if "decoder_floor" in state.extra:
            return windows, (self._keep(kept), kept.n_tokens, kept.nbytes)
        snapshot = state.clone()
        return windows, (self._keep(_KeptTurnEnd(kept, snapshot, windows)), kept.n_tokens,
                         held_bytes(state_tensors(snapshot)) + len(windows))  # fmt: skip

    def op_export_turn_end(
        self, model: str, sid: int, ranges: Sequence[tuple[int, int]], keep: bool
    ) -> tuple[list[bytes], bytes, tuple[int | None, int, int]]:
        """A persisted turn end in one call: `op_export_global` of each range, then
        `op_export_windows_keeping` of the same state."""
        blobs = [self.op_export_global(model, sid, start, end) for start, end in ranges]
        windows, kept = self.op_export_windows_keeping(model, sid, keep)
        return blobs, windows, kept

    def op_fill_decoded(self, model: str, sid: int, kept_id: int) -> int:
        state = self._state(sid)
        self.compute.fill_decoded(self._served(model), state, self._sources(kept_id))
        return state.n_tokens

    def op_restore_decoded(self, model: str, kept_id: int, tokens: Sequence[int]) -> tuple[int, int]:
        """A fresh state filled from kept decoded global KV and sealed as `tokens` (one round trip for
        what the turn engine's full hit does in three: `engine.restore_decoded`)."""
        from orchestrator.engine.model_compute import restore_decoded

        state = restore_decoded(self.compute, self._served(model), self._sources(kept_id), tokens)
        return self._keep(state), state.n_tokens

    def op_restore_with_windows(
        self, model: str, kept_id: int, tokens: Sequence[int], blob: bytes
    ) -> tuple[int, int]:
        """`op_restore_decoded` with the windows imported into the restored state (what restoring the
        prefix and then `op_clone_with_windows` of it gives a full hit, without the prefix or its copy);
        kept only when the windows fit (CacheFormatError). A turn end's snapshot whose windows are `blob`
        and whose history is `tokens` is that state already: a copy of it is kept instead."""
        import torch

        from orchestrator.engine.model_compute import restore_decoded, token_row

        kept = self._state(kept_id)
        if isinstance(kept, _KeptTurnEnd):
            snapshot = kept.snapshot
            same_history = snapshot.n_tokens == len(tokens) and torch.equal(
                snapshot.tokens, token_row(tokens, snapshot.device)
            )
            if same_history and blob == kept.windows:
                with self._lock:
                    self.snapshot_restores += 1
                state = snapshot.clone()
                # as the import leaves it: the other key (`index_k_slot`) serves conformance's reference
                # slots only, which no served pass reads
                state.extra.clear()
                return self._keep(state), state.n_tokens
            kept = kept.sources
        served = self._served(model)
        state = restore_decoded(self.compute, served, kept, tokens)
        self.compute.import_windows(served, state, blob)
        return self._keep(state), state.n_tokens

    def op_clone_with_windows(self, model: str, sid: int, blob: bytes) -> tuple[int, int]:
        """A copy of the state with the windows imported, kept only when they fit (CacheFormatError)."""
        from orchestrator.engine.model_compute import clone_with_windows

        copy = clone_with_windows(self.compute, self._served(model), self._state(sid), blob)
        return self._keep(copy), copy.n_tokens

    def op_prefill(self, model: str, tokens: Sequence[int], sid: int | None, prompt_end: int) -> WireOutput:
        out = self.compute.prefill(self._served(model), tokens, self._state(sid), prompt_end=prompt_end)
        return self._output(out, sid)

    def op_decode(self, model: str, token: int, sid: int) -> WireOutput:
        return self._output(self.compute.decode(self._served(model), token, self._state(sid)), sid)

    def op_decode_many(
        self, model: str, tokens: Sequence[int], sids: Sequence[int], logits: Sequence[str] | None = None
    ) -> WireOutputs:
        """`logits`: what of each output's logits to send back (`WireOutputs.pack`; None: all)."""
        check_wanted(logits, len(sids))
        states = [self._state(s) for s in sids]
        return self._outputs(self.compute.decode_many(self._served(model), tokens, states), sids, logits)

    def op_prefill_many(
        self,
        model: str,
        chunks: Sequence[Sequence[int]],
        sids: Sequence[int | None],
        prompt_ends: Sequence[int],
        logits: Sequence[str] | None = None,
    ) -> WireOutputs:
        check_wanted(logits, len(sids))
        states = [self._state(s) for s in sids]
        outs = self.compute.prefill_many(self._served(model), chunks, states, prompt_ends)
        return self._outputs(outs, sids, logits)

    def _account(self, op: str, cpu: float, wall: float) -> None:
        with self._lock:
            entry = self._op_times.setdefault(op, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += cpu
            entry[2] += wall

    # -- serving --------------------------------------------------------------------------------------

    def call(self, request: tuple[str, tuple[Any, ...], Sequence[int]]) -> Any:
        """One call `(op, args, frees)`: frees the states named, then runs `op_<op>(*args)`."""
        op, args, frees = request
        if frees:
            self.free(frees)
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise ValueError(f"model process: unknown operation {op!r}")
        c0, w0 = time.thread_time(), time.perf_counter()
        value = handler(*args)
        self._account(op, time.thread_time() - c0, time.perf_counter() - w0)
        return value

    def serve(self, conn: Connection) -> None:
        import torch

        with torch.inference_mode():
            serve_calls(conn, self.call, "model process")


def serve_forever(config: WorkerConfig) -> None:
    """Load the models, print the ready line, and serve connections until the process ends."""
    worker = _Worker(config)
    if config.tune_gc:
        from orchestrator.heap import tune_gc_for_serving

        worker.frozen_objects = tune_gc_for_serving().objects
    serve_connections(config.authkey, worker.serve, "kvresume-model-conn")
