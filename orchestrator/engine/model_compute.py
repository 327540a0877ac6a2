"""Every operation the turn engine performs on a model and its cache state, behind one seam: the real
torch model (`TorchCompute`), or a stand-in that skips the compute (benchmarks of service overhead).

Knows nothing of sessions or storage. States are opaque to the engine except for `n_tokens` and `clone`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from model import (
    CacheFormatError,
    ModelState,
    PassOutput,
    decode,
    decode_many,
    export_global,
    export_windows,
    import_global,
    import_global_chunks,
    import_windows,
    prefill,
    prefill_many,
)
from orchestrator.engine.decoded_states import KeptDecoded, TensorSources
from orchestrator.engine.served_models import ServedModel

__all__ = [
    "ModelCompute",
    "TorchCompute",
    "TurnEndExport",
    "clone_with_windows",
    "export_turn_end",
    "export_windows_keeping",
    "import_chunks",
    "restore_decoded",
]


class ModelCompute(Protocol):
    """Model operations of a turn. `state` objects expose `n_tokens` and `clone()`.

    Cache-format failures raise `model.CacheFormatError` (the engine treats them as a miss).
    """

    def new_state(self, served: ServedModel) -> Any: ...

    def import_chunk(self, served: ServedModel, state: Any, blob: bytes) -> int:
        """Append one global chunk; returns its end position. A compute may also offer
        `import_chunks(served, state, blobs) -> (appended, error)` for many at once (see `import_chunks`)."""
        ...

    def seal_prefix(self, served: ServedModel, state: Any, tokens: Sequence[int]) -> None:
        """Mark the imported chunks as the history `tokens`, windows absent (a replay rebuilds them)."""
        ...

    def import_windows(self, served: ServedModel, state: Any, blob: bytes) -> None: ...

    def export_global(self, served: ServedModel, state: Any, start: int, end: int) -> bytes: ...

    def export_windows(self, served: ServedModel, state: Any) -> bytes: ...

    def prefill(
        self, served: ServedModel, tokens: Sequence[int], state: Any, *, prompt_end: int
    ) -> PassOutput:
        """`ced` prefill of new prompt tokens onto `state` (None: from position 0)."""
        ...

    def decode(self, served: ServedModel, token: int, state: Any) -> PassOutput: ...

    def decode_many(
        self, served: ServedModel, tokens: Sequence[int], states: Sequence[Any]
    ) -> list[PassOutput]:
        """One decode step of many sessions; each output equals its `decode` bit for bit."""
        ...

    def prefill_many(
        self, served: ServedModel, chunks: Sequence[Sequence[int]], states: Sequence[Any],
        prompt_ends: Sequence[int],
    ) -> list[PassOutput]:
        """The prefill chunks of many sessions in one pass; each output equals its `prefill` bit for bit.
        Optional: a scheduler runs `prefill` one chunk at a time when a compute lacks it."""
        ...

    def keep_decoded(self, served: ServedModel, state: Any) -> KeptDecoded | None:
        """Keep `state`'s decoded global KV for a later `fill_decoded` (engine/decoded_states.py), or
        None when this compute keeps nothing of such a state. Optional: without it nothing is kept and
        every full hit imports its chunks."""
        ...

    def fill_decoded(self, served: ServedModel, state: Any, kept: KeptDecoded) -> None:
        """Write what `keep_decoded` kept into `state`, a fresh state of this compute, as importing the
        chunks it was exported to would."""
        ...


def import_chunks(
    compute: ModelCompute, served: ServedModel, state: Any, blobs: Sequence[bytes]
) -> tuple[int, CacheFormatError | None]:
    """Append consecutive global chunks through `compute`: its `import_chunks` when it has one (one
    linear-time import), else `import_chunk` one at a time.

    Returns:
        how many chunks, from the first, were appended, and the cache-format error that refused the next
        one (None when all were appended).
    """
    many = getattr(compute, "import_chunks", None)
    if many is not None:
        return many(served, state, blobs)
    for i, blob in enumerate(blobs):
        try:
            compute.import_chunk(served, state, blob)
        except CacheFormatError as exc:
            return i, exc
    return len(blobs), None


def restore_decoded(
    compute: ModelCompute, served: ServedModel, kept: KeptDecoded, tokens: Sequence[int]
) -> Any:
    """A fresh state holding what `keep_decoded` kept, sealed as the history `tokens` (a full hit's prefix
    state): the compute's `restore_decoded` when it has one (one call: a model process's round trip),
    else `new_state`, `fill_decoded` and `seal_prefix`."""
    one = getattr(compute, "restore_decoded", None)
    if one is not None:
        return one(served, kept, tokens)
    state = compute.new_state(served)
    compute.fill_decoded(served, state, kept)
    compute.seal_prefix(served, state, tokens)
    return state


def clone_with_windows(compute: ModelCompute, served: ServedModel, state: Any, blob: bytes) -> Any:
    """A copy of `state` with the pool entry's windows `blob` imported (the original keeps none): the
    compute's `clone_with_windows` when it has one, else `state.clone()` and `import_windows`.

    Raises:
        CacheFormatError: the windows do not fit the state (nothing is kept of the copy).
    """
    one = getattr(compute, "clone_with_windows", None)
    if one is not None:
        return one(served, state, blob)
    copy = state.clone()
    compute.import_windows(served, copy, blob)
    return copy


def export_windows_keeping(
    compute: ModelCompute, served: ServedModel, state: Any, *, keep: bool
) -> tuple[bytes, KeptDecoded | None]:
    """A turn end's windows blob and, with `keep`, its decoded global KV kept (`keep_decoded`; None when
    not asked for or nothing was kept): the compute's `export_windows_keeping` when it has one (a model
    process answers both in one round trip), else `export_windows` and then `keep_decoded`, where the
    compute has it."""
    both = getattr(compute, "export_windows_keeping", None)
    if both is not None:
        return both(served, state, keep=keep)
    windows = compute.export_windows(served, state)
    one = getattr(compute, "keep_decoded", None) if keep else None
    return windows, (one(served, state) if one is not None else None)


@dataclass(frozen=True)
class TurnEndExport:
    """What a persisted turn end takes from its state: the global-KV payloads of the chunks it writes,
    by range, and what its pool put needs (the windows blob, and the decoded KV kept beside them)."""

    global_blobs: dict[tuple[int, int], bytes]
    windows: bytes
    kept: KeptDecoded | None


def export_turn_end(
    compute: ModelCompute,
    served: ServedModel,
    state: Any,
    ranges: Sequence[tuple[int, int]],
    *,
    keep: bool,
) -> TurnEndExport:
    """`export_global` of each of `ranges` and `export_windows_keeping` of the same state: the compute's
    `export_turn_end` when it has one (a model process answers all of them in one round trip, where they
    were 1.33 + 1 round trips a turn), else those calls one by one."""
    one = getattr(compute, "export_turn_end", None)
    if one is not None:
        return one(served, state, ranges, keep=keep)
    blobs = {(start, end): compute.export_global(served, state, start, end) for start, end in ranges}
    windows, kept = export_windows_keeping(compute, served, state, keep=keep)
    return TurnEndExport(global_blobs=blobs, windows=windows, kept=kept)


def token_row(tokens: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """[1, n] int64 of `tokens` on `device`: through an `array` of the ids rather than `torch.tensor` of a
    list (a 700-token history: 24 instead of 65 us; a full hit seals one every turn).

    Raises:
        OverflowError, TypeError: an id that is not an int64.
    """
    ids = array("q", tokens)
    if not ids:
        return torch.zeros(1, 0, dtype=torch.int64, device=device)
    # frombuffer shares the array's memory and keeps the array alive while the tensor lives
    return torch.frombuffer(ids, dtype=torch.int64).view(1, -1).to(device)


def _lone_decodable(model: Any, token: int, state: Any) -> bool:
    """Whether a one-sequence decode step may run as the lone `decode`: a batch-1 CPU state and a token id
    `decode_many` accepts (anything else goes to it, for its errors). CPU only: there `decode_many` equals
    `decode` bit for bit (tests/model/test_batched.py); on a GPU that is not tested, so a session alone
    keeps the pass that steps shared with others run."""
    return (
        isinstance(state, ModelState)
        and state.batch == 1
        and state.device.type == "cpu"
        and isinstance(token, int)
        and 0 <= token < model.cfg.vocab_size
    )


class TorchCompute:
    """The real model: `model.prefill` in `ced` mode, `model.decode`, the cache format's exports/imports.
    Forward passes hold the served model's lock (one pass at a time per model)."""

    def new_state(self, served: ServedModel) -> Any:
        return served.model.new_state(1)

    def import_chunk(self, served: ServedModel, state: Any, blob: bytes) -> int:
        return import_global(state, blob, fingerprint=served.fingerprint)

    def import_chunks(
        self, served: ServedModel, state: Any, blobs: Sequence[bytes]
    ) -> tuple[int, CacheFormatError | None]:
        """Append consecutive chunks in time linear in the history (`model.import_global_chunks`)."""
        done = import_global_chunks(state, list(blobs), fingerprint=served.fingerprint)
        return done.imported, CacheFormatError(done.failure) if done.failure is not None else None

    def seal_prefix(self, served: ServedModel, state: Any, tokens: Sequence[int]) -> None:
        state.tokens = token_row(tokens, state.device)
        state.drop_windows(range(served.model.cfg.n_layers))
        state.drop_encoder_rows()

    def restore_decoded(self, served: ServedModel, kept: KeptDecoded, tokens: Sequence[int]) -> ModelState:
        """`new_state`, `fill_decoded` and `seal_prefix` (the same state), without the seal's fresh zero
        rings: a new state's rings are zeros already, so marking them absent is all the seal has left to
        do (a full hit restores a state every turn; the rings were 20 allocations of its 0.38 ms)."""
        state = served.model.new_state(1)
        self.fill_decoded(served, state, kept)
        state.tokens = token_row(tokens, state.device)
        n = state.n_tokens
        state.window_from = [n] * len(state.window_from)
        state.enc_from = n
        return state

    def import_windows(self, served: ServedModel, state: Any, blob: bytes) -> None:
        import_windows(served.model, state, blob, fingerprint=served.fingerprint)

    def export_global(self, served: ServedModel, state: Any, start: int, end: int) -> bytes:
        return export_global(state, start, end, fingerprint=served.fingerprint)

    def export_windows(self, served: ServedModel, state: Any) -> bytes:
        return export_windows(served.model, state, fingerprint=served.fingerprint)

    def prefill(
        self, served: ServedModel, tokens: Sequence[int], state: Any, *, prompt_end: int
    ) -> PassOutput:
        device = served.model.head.weight.device
        toks = torch.tensor([list(tokens)], dtype=torch.int64, device=device)
        with served.lock, torch.inference_mode():
            return prefill(served.model, toks, state, mode="ced", prompt_end=prompt_end)

    def decode(self, served: ServedModel, token: int, state: Any) -> PassOutput:
        with served.lock, torch.inference_mode():
            return decode(served.model, torch.tensor([token], device=state.device), state)

    def decode_many(
        self, served: ServedModel, tokens: Sequence[int], states: Sequence[Any]
    ) -> list[PassOutput]:
        if len(states) == 1 and _lone_decodable(served.model, tokens[0], states[0]):
            # One sequence (a session decoding alone): its lone pass, the same bits as `decode_many`'s
            # (that is decode_many's contract) without the batched stage's fixed cost: on v41-sib-s a 1-row
            # decode_many took 7.3 ms against 6.3 for the lone decode (AMD EPYC VM, session 43). Here, not
            # in the scheduler (which sends a lone prompt chunk to `prefill`): a model process's decode pass
            # brings back only the logits its chain reads.
            return [self.decode(served, tokens[0], states[0])]
        with served.lock, torch.inference_mode():
            return decode_many(served.model, tokens, states)

    def keep_decoded(self, served: ServedModel, state: Any) -> TensorSources | None:
        """The state's global-KV tensors, shared (a batch-1 `ModelState`; None for any other)."""
        if not isinstance(state, ModelState) or state.batch != 1:
            return None
        return TensorSources.of(state)

    def fill_decoded(self, served: ServedModel, state: Any, kept: KeptDecoded) -> None:
        if not isinstance(kept, TensorSources):
            raise TypeError(f"{type(kept).__name__} was not kept by this process's model")
        kept.fill(state)

    def prefill_many(
        self, served: ServedModel, chunks: Sequence[Sequence[int]], states: Sequence[Any],
        prompt_ends: Sequence[int],
    ) -> list[PassOutput]:
        device = served.model.head.weight.device
        toks = [torch.tensor([list(c)], dtype=torch.int64, device=device) for c in chunks]
        with served.lock, torch.inference_mode():
            return prefill_many(served.model, toks, states, prompt_ends=prompt_ends, mode="ced")
