"""Decoded global KV of sessions' committed turn ends, kept in RAM so that a full hit does not dequantize
the whole stored history again (issue 16).

What is kept: per (tenant, session), the six global-KV tensors of every kv source of the state at the
turn end (main KV and index keys, dequantized, and their stored codes and scales), the history length
and the chunks digest (`pool_entry.chunks_digest_of`) the turn's pool entry carries, and that pool entry's
bytes. It is a memo of one pure function: `model.import_global_chunks` of the stored chunks whose bytes
have that digest. Those bytes are the ones the state exported or was itself imported from (persist
computes the digest over exactly them), and a state's global KV is exactly the dequantization of its
stored codes (model/state.py), so importing the chunks gives the same tensors; the slow twin tests
check it tensor for tensor (torch.equal) and turn for turn.

When it is used (`read_prefix(decoded=...)`): only when the verified, registry-named stored chunks of the
prefix being read end exactly at the memo's length and their ranges and payload sha256s give the memo's
chunks digest, i.e. when the full hit that pool entry serves would be taken over exactly the bytes the
memo decodes. Reading and verifying the chunks still happens (that proves they are still stored, named
and within retention); only the dequantize and concatenate are skipped. Anything else is a miss and the
import runs.

Where it lives: with the compute that ran the turn (`keep_decoded` / `fill_decoded` of `ModelCompute`).
`TorchCompute` keeps the tensors in this process (`TensorSources`); with `model_process = "separate"` the
model process keeps them beside its states and this process holds a handle (`RemoteKept`: freed there
when dropped here, unusable, so a miss, once that process ended). The LRU, the budget and the pool's
ownership below are this process's either way.

Owner: the window pool. An entry is put only beside the pool entry of the same turn end and is found
only through the pool's current value for that session (`get` compares it); `WindowPool.on_drop` removes
it whenever the pool drops that value (a put replacing it, discard on session/tenant/model purge or a
residency change, TTL expiry, LRU eviction). So it never outlives or contradicts the pool. Its own byte
budget bounds it further (least recently used first); 0 disables it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from model import ModelState
from orchestrator.engine.pool_entry import chunks_digest_of
from storage import WindowPool

__all__ = [
    "SOURCE_FIELDS",
    "DecodedSources",
    "DecodedStates",
    "DecodedStats",
    "KeptDecoded",
    "TensorSources",
    "held_bytes",
    "state_tensors",
]

# The fields of a SourceCache that `model.import_global_chunks` writes (the rest come from `new_state`,
# `seal_prefix` and the windows import, as on the import path).
SOURCE_FIELDS = ("kv", "index_k", "kv_packed", "kv_scales", "index_packed", "index_scales")


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages the tensors pin (a view of a growing append buffer pins all of it)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def state_tensors(state: ModelState) -> list[torch.Tensor]:
    """Every tensor a state holds: its history, each kv source's fields and carries, the rings and their
    stored forms, the encoder rows (what a snapshot of it pins, with `held_bytes`)."""
    tensors = [state.tokens, *state.windows, *state.window_codes, *state.window_scales]
    for src in state.sources.values():
        # (not `dataclasses.astuple`: it deep-copies every tensor)
        fields = (getattr(src, f.name) for f in dataclasses.fields(src))
        tensors += [t for t in fields if isinstance(t, torch.Tensor)]
    return tensors + [t for t in (state.enc_lanes, state.enc_pre) if t is not None]


@dataclass(frozen=True, kw_only=True)
class TensorSources:
    """What `TorchCompute.keep_decoded` keeps of a batch-1 `ModelState`: the `SOURCE_FIELDS` tensors of
    every kv source holding entries, at history length `n_tokens` (in the model process, the same object
    lives there and this process holds a handle to it: `model_process.RemoteKept`).

    Attributes:
        fields: kv-source layer -> the `SOURCE_FIELDS` tensors (only layers holding at least one entry;
            the import leaves the others as `new_state` made them). Shared, never written.
        nbytes: bytes of the storages the tensors pin.
    """

    n_tokens: int
    fields: dict[int, tuple[torch.Tensor, ...]]
    nbytes: int

    @property
    def usable(self) -> bool:
        """Always: tensors of this process fill a state as long as they are held (a model process's
        handle is not, once that process ended)."""
        return True

    @classmethod
    def of(cls, state: ModelState) -> TensorSources:
        """Capture `state`'s global KV (its tensors are shared: forwards replace, never mutate them)."""
        fields = {
            layer: tuple(getattr(src, name) for name in SOURCE_FIELDS)
            for layer, src in state.sources.items()
            if src.n_entries > 0
        }
        nbytes = held_bytes([t for ts in fields.values() for t in ts])
        return cls(n_tokens=state.n_tokens, fields=fields, nbytes=nbytes)

    def fill(self, state: ModelState) -> None:
        """Write the decoded global KV into a fresh state, as `import_global_chunks` of the chunks would."""
        for layer, src in state.sources.items():
            if src.n_entries != 0:
                raise ValueError(f"layer {layer} already holds {src.n_entries} entries: not a fresh state")
        missing = set(self.fields) - set(state.sources)
        if missing:
            raise ValueError(f"decoded layers {sorted(missing)} are not kv sources of this state")
        for layer, tensors in self.fields.items():
            state.sources[layer] = dataclasses.replace(
                state.sources[layer], **dict(zip(SOURCE_FIELDS, tensors, strict=True))
            )


class KeptDecoded(Protocol):
    """What a compute's `keep_decoded` returns: opaque but for its history length, the bytes it holds,
    and whether it can still fill a state (a model process's handle cannot once that process ended)."""

    n_tokens: int
    nbytes: int

    @property
    def usable(self) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class DecodedSources:
    """The decoded global KV of a history [0, n_tokens) whose stored chunks have digest `chunks`, as the
    compute that ran the turn kept it (`kept`: `TensorSources` in this process, a handle to them in a
    model process); that compute's `fill_decoded` writes it into a state.
    """

    fingerprint: bytes
    chunks: bytes
    kept: KeptDecoded

    @property
    def n_tokens(self) -> int:
        return self.kept.n_tokens

    @property
    def nbytes(self) -> int:
        return self.kept.nbytes

    def matches(self, ranges: list[tuple[int, int]], payload_hashes: list[bytes]) -> bool:
        """Whether stored chunks of these ranges and payload digests are exactly what this decodes (and
        what it decodes can still fill a state)."""
        if not ranges or ranges[-1][1] != self.n_tokens or not self.kept.usable:
            return False
        return chunks_digest_of(ranges, payload_hashes) == self.chunks


@dataclass(frozen=True, kw_only=True)
class DecodedStats:
    entries: int
    bytes_used: int
    budget_bytes: int
    hits: int
    misses: int
    evicted: int


@dataclass(kw_only=True)
class _Entry:
    sources: DecodedSources
    pool_value: bytes


class DecodedStates:
    """Thread-safe LRU of `DecodedSources` by (tenant, session), owned by a window pool (module docstring).

    Args:
        budget_bytes: most bytes of tensors held at once (0: disabled; nothing is kept).
        pool: the pool whose entries these follow (registers a drop listener on it).
        metrics: optional ServiceMetrics (`decoded_state_lookups`, `decoded_state_bytes`).
    """

    def __init__(
        self, budget_bytes: int, *, pool: WindowPool | None = None, metrics: Any | None = None
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"decoded_state_budget_bytes={budget_bytes} must be >= 0 (0 disables)")
        self.budget_bytes = budget_bytes
        self._metrics = metrics
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evicted = 0
        if pool is not None:
            pool.on_drop(self._pool_dropped)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def put(
        self,
        tenant: str,
        session: str,
        *,
        kept: KeptDecoded | None,
        fingerprint: bytes,
        chunks: bytes,
        pool_value: bytes,
    ) -> bool:
        """Keep a turn end's decoded global KV, `kept` (what the compute's `keep_decoded` returned:
        `model_compute.export_turn_end` asks for it with the windows' export), beside the pool
        entry `pool_value` of the same turn end; call before the pool put of that value (the put drops the
        previous value, whose entry goes). Returns whether it was kept (not when disabled, over the whole
        budget, or when the compute kept nothing (None): a batched state, a stand-in's without
        `keep_decoded`)."""
        if not self.enabled or kept is None:
            return False
        sources = DecodedSources(fingerprint=fingerprint, chunks=chunks, kept=kept)
        with self._lock:
            self._drop((tenant, session))
            if sources.nbytes > self.budget_bytes:
                self._report()
                return False
            while self._bytes + sources.nbytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                self._evicted += 1
            self._entries[(tenant, session)] = _Entry(sources=sources, pool_value=pool_value)
            self._bytes += sources.nbytes
            self._report()
            return True

    def get(
        self, tenant: str, session: str, *, fingerprint: bytes, pool_value: bytes
    ) -> DecodedSources | None:
        """The decoded sources kept beside exactly `pool_value` (the pool's current value for the session,
        as the full hit found it) under `fingerprint`; None otherwise. Refreshes recency."""
        if not self.enabled:
            return None
        with self._lock:
            entry = self._entries.get((tenant, session))
            if entry is None or entry.pool_value != pool_value or entry.sources.fingerprint != fingerprint:
                return None
            self._entries.move_to_end((tenant, session))
            return entry.sources

    def record(self, *, hit: bool) -> None:
        """Count one full-hit candidate's lookup: served from here (hit) or imported (miss)."""
        if not self.enabled:
            return
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1
        if self._metrics is not None:
            m = self._metrics
            m.child(m.decoded_state_lookups, result="hit" if hit else "miss").inc()

    def discard(self, tenant: str, session: str) -> bool:
        with self._lock:
            found = self._drop((tenant, session))
            self._report()
            return found

    def stats(self) -> DecodedStats:
        with self._lock:
            return DecodedStats(
                entries=len(self._entries),
                bytes_used=self._bytes,
                budget_bytes=self.budget_bytes,
                hits=self._hits,
                misses=self._misses,
                evicted=self._evicted,
            )

    def _pool_dropped(self, tenant: str, session: str, value: bytes) -> None:
        # Runs under the pool's lock: takes only this lock, never calls the pool.
        with self._lock:
            entry = self._entries.get((tenant, session))
            if entry is not None and entry.pool_value == value:
                self._drop((tenant, session))
                self._report()

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.sources.nbytes
        return True

    def _report(self) -> None:
        if self._metrics is not None:
            self._metrics.decoded_state_bytes.set(self._bytes)
