"""The model process (`model_process = "separate"`): `ProcessCompute` gives what `TorchCompute` gives in
this process, bit for bit, on fresh random prompts; it frees the states whose handles are gone, refuses a
model process that computes under another fingerprint, survives the death of its model process (the
states are lost, the next call starts a new one), and its model process ends when its parent is killed.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from model import CacheFormatError, state_from_global
from orchestrator.api import GenerationSpec
from orchestrator.child_launcher import LaunchedChild
from orchestrator.engine import ModelRegistry, Sampler, ServedModelSpec, TorchCompute
from orchestrator.engine.decoded_states import held_bytes, state_tensors
from orchestrator.engine.global_kv import chunk_ranges
from orchestrator.engine.model_compute import (
    clone_with_windows,
    export_turn_end,
    export_windows_keeping,
    restore_decoded,
)
from orchestrator.engine.sampler import ChosenToken, greedy_token
from orchestrator.heap import YOUNG_THRESHOLD
from orchestrator.model_process import ModelProcessError, ProcessCompute, RemoteState
from tests.processes import process_alive

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def models() -> ModelRegistry:
    return ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)})


@pytest.fixture(scope="module")
def remote(models: ModelRegistry):
    compute = ProcessCompute.from_registry(models, threads=1, connections=4)
    yield compute
    compute.close()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 512) for _ in range(n)]


def _seeded() -> tuple[int, random.Random]:
    """A fresh seed (named in assertion messages) and the generator it seeds."""
    seed = random.randrange(1 << 30)
    return seed, random.Random(seed)


def _lived_here_and_there(
    local: TorchCompute, remote: ProcessCompute, served, rng: random.Random, prompt_tokens: int, decodes: int
) -> tuple[Any, Any, list[int]]:
    """One random history lived here and there: a prefill of `prompt_tokens` random ids, then `decodes`
    decode steps of random ids; (the state here, the state there, the history)."""
    torch.set_num_threads(1)
    prompt = _prompt(rng, prompt_tokens)
    live_a = local.prefill(served, prompt, None, prompt_end=len(prompt)).state
    live_b = remote.prefill(served, prompt, None, prompt_end=len(prompt)).state
    history = list(prompt)
    for _ in range(decodes):
        token = rng.randrange(16, 512)
        live_a, live_b = local.decode(served, token, live_a).state, remote.decode(served, token, live_b).state
        history.append(token)
    return live_a, live_b, history


def _continued_alike(
    local: TorchCompute, remote: ProcessCompute, served, rng: random.Random, states: tuple[Any, Any],
    n: int, step: list[int], decodes: int, seed: int,
) -> tuple[Any, Any]:
    """States of the same `n`-token history here and there, continued alike by the prompt chunk `step`
    and `decodes` decode steps of random ids: the same stats and logits at each pass and the same global
    KV export at the end; the last outputs (here, there)."""
    out_a = local.prefill(served, step, states[0], prompt_end=n + len(step))
    out_b = remote.prefill(served, step, states[1], prompt_end=n + len(step))
    assert out_a.stats == out_b.stats and torch.equal(out_a.logits, out_b.logits), f"seed {seed}"
    for _ in range(decodes):
        t = rng.randrange(16, 512)
        out_a, out_b = local.decode(served, t, out_a.state), remote.decode(served, t, out_b.state)
        assert torch.equal(out_a.logits, out_b.logits), f"seed {seed}"
    end = out_a.state.n_tokens
    here = local.export_global(served, out_a.state, 0, end)
    assert here == remote.export_global(served, out_b.state, 0, end), f"seed {seed}"
    return out_a, out_b


def _prefilled_both_ways(models: ModelRegistry, remote: ProcessCompute):  # type: ignore[no-untyped-def]
    """Three fresh prompts prefilled in this process and in the model process: (served model, the
    in-process compute, the seed, its generator, the outputs here, the outputs there)."""
    torch.set_num_threads(1)
    served = models.get("a")
    local = TorchCompute()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [_prompt(rng, rng.randrange(5, 70)) for _ in range(3)]
    mine = [local.prefill(served, p, None, prompt_end=len(p)) for p in prompts]
    theirs = [remote.prefill(served, p, None, prompt_end=len(p)) for p in prompts]
    return served, local, seed, rng, mine, theirs


def test_passes_and_exports_equal_in_process_compute(models: ModelRegistry, remote: ProcessCompute) -> None:
    served, local, seed, rng, mine, theirs = _prefilled_both_ways(models, remote)
    for a, b in zip(mine, theirs, strict=True):
        assert isinstance(b.state, RemoteState) and b.state.n_tokens == a.state.n_tokens
        assert torch.equal(a.logits, b.logits), f"seed {seed}"
        assert a.stats == b.stats
    states_a, states_b = [o.state for o in mine], [o.state for o in theirs]
    for _ in range(3):  # batched decode steps, then a batched prefill chunk each
        tokens = [rng.randrange(16, 512) for _ in states_a]
        outs_a = local.decode_many(served, tokens, states_a)
        outs_b = remote.decode_many(served, tokens, states_b)
        for a, b in zip(outs_a, outs_b, strict=True):
            assert torch.equal(a.logits, b.logits), f"seed {seed}"
        assert [s.n_tokens for s in states_b] == [s.n_tokens for s in states_a]
    chunks = [_prompt(rng, rng.randrange(1, 9)) for _ in states_a]
    ends = [s.n_tokens + len(c) for s, c in zip(states_a, chunks, strict=True)]
    outs_a = local.prefill_many(served, chunks, states_a, ends)
    outs_b = remote.prefill_many(served, chunks, states_b, ends)
    for a, b in zip(outs_a, outs_b, strict=True):
        assert torch.equal(a.logits, b.logits), f"seed {seed}"
        assert b.state is not None
    # a batched pass whose outputs mix logits and none (chunks that end before their prompt), with a
    # sequence that starts from nothing (its state is made there): each output as in-process compute's
    chunks = [_prompt(rng, rng.randrange(1, 9)) for _ in range(len(states_a) + 1)]
    # every other prompt goes on far past its chunk: its decoder does not run, so it has no logits
    ends = [s.n_tokens + len(chunks[i]) + (i % 2) * 200 for i, s in enumerate(states_a)]
    ends.append(len(chunks[-1]))
    outs_a = local.prefill_many(served, chunks, [*states_a, None], ends)
    outs_b = remote.prefill_many(served, chunks, [*states_b, None], ends)
    assert [o.logits is None for o in outs_b] == [o.logits is None for o in outs_a]
    assert any(o.logits is None for o in outs_a) and any(o.logits is not None for o in outs_a)
    for a, b in zip(outs_a, outs_b, strict=True):
        assert (a.logits is None) or torch.equal(a.logits, b.logits), f"seed {seed}"
        assert a.stats == b.stats and b.state.n_tokens == a.state.n_tokens
    assert isinstance(outs_b[-1].state, RemoteState)
    states_a.append(outs_a[-1].state)
    states_b.append(outs_b[-1].state)
    for a, b in zip(states_a, states_b, strict=True):
        n = a.n_tokens - a.n_tokens % 32
        assert local.export_global(served, a, 0, n) == remote.export_global(served, b, 0, n)
        assert local.export_windows(served, a) == remote.export_windows(served, b)


def test_a_pass_brings_back_only_the_logits_asked_for(models: ModelRegistry, remote: ProcessCompute) -> None:
    """`start_decode_many` / `start_prefill_many` with `logits`: a row asked for whole equals in-process
    compute's bit for bit, a greedy choice is `greedy_token` of in-process compute's row (what a greedy
    Sampler picks from it), and a row asked for nothing comes back without logits; the states advance
    the same either way. A malformed request is refused before the pass runs."""
    served, local, seed, rng, mine, theirs = _prefilled_both_ways(models, remote)
    states_a, states_b = [o.state for o in mine], [o.state for o in theirs]
    wanted = ["argmax", "full", "none"]
    greedy = Sampler(GenerationSpec(max_new_tokens=1))
    for _ in range(3):
        tokens = [rng.randrange(16, 512) for _ in states_a]
        outs_a = local.decode_many(served, tokens, states_a)
        outs_b = remote.start_decode_many(served, tokens, states_b, logits=wanted)()
        for want, a, b in zip(wanted, outs_a, outs_b, strict=True):
            if want == "argmax":
                assert isinstance(b.logits, ChosenToken), f"seed {seed}"
                assert b.logits.token == greedy_token(a.logits) == greedy(a.logits) == greedy(b.logits)
            elif want == "full":
                assert torch.equal(b.logits, a.logits), f"seed {seed}"
            else:
                assert b.logits is None
        assert [s.n_tokens for s in states_b] == [s.n_tokens for s in states_a]
        rng.shuffle(wanted)
    chunks = [_prompt(rng, rng.randrange(1, 9)) for _ in states_a]
    ends = [s.n_tokens + len(c) for s, c in zip(states_a, chunks, strict=True)]
    outs_a = local.prefill_many(served, chunks, states_a, ends)
    outs_b = remote.start_prefill_many(served, chunks, states_b, ends, logits=["none", "argmax", "full"])()
    assert outs_b[0].logits is None
    assert outs_b[1].logits == ChosenToken(greedy_token(outs_a[1].logits)), f"seed {seed}"
    assert torch.equal(outs_b[2].logits, outs_a[2].logits), f"seed {seed}"
    for a, b in zip(states_a, states_b, strict=True):
        assert local.export_windows(served, a) == remote.export_windows(served, b)
    before = [s.n_tokens for s in states_b]
    for bad in (["full"], ["full", "some", "none"]):
        with pytest.raises(ValueError, match="logits must give one of"):
            remote.start_decode_many(served, [5, 6, 7], states_b, logits=bad)()
    assert [s.n_tokens for s in states_b] == before  # refused before the pass ran


def test_imports_clone_and_seal_equal_in_process_compute(
    models: ModelRegistry, remote: ProcessCompute
) -> None:
    served = models.get("a")
    local = TorchCompute()
    rng = random.Random()
    prompt = _prompt(rng, 64 + rng.randrange(0, 30))
    src = local.prefill(served, prompt, None, prompt_end=len(prompt)).state
    blobs = [local.export_global(served, src, i, i + 32) for i in (0, 32)]
    windows = local.export_windows(served, src)
    a, b = local.new_state(served), remote.new_state(served)
    assert local.import_chunks(served, a, blobs)[0] == remote.import_chunks(served, b, blobs)[0] == 2
    local.seal_prefix(served, a, prompt[:64])
    remote.seal_prefix(served, b, prompt[:64])
    assert b.n_tokens == a.n_tokens == 64
    a2, b2 = a.clone(), b.clone()
    assert isinstance(b2, RemoteState) and b2.state_id != b.state_id
    step = prompt[64:] or [17]
    out_a = local.prefill(served, step, a2, prompt_end=64 + len(step))
    out_b = remote.prefill(served, step, b2, prompt_end=64 + len(step))
    assert out_b.state is b2 and b2.n_tokens == a2.n_tokens
    assert torch.equal(out_a.logits, out_b.logits)
    # a corrupt chunk is the same CacheFormatError, raised here
    fresh = remote.new_state(served)
    done, error = remote.import_chunks(served, fresh, [blobs[0][:-3]])
    assert done == 0 and isinstance(error, CacheFormatError)
    with pytest.raises(CacheFormatError):
        remote.import_windows(served, remote.new_state(served), windows[:-5])
    # a model swap's receiver state is built there by model.state_from_global
    history = torch.tensor([prompt[:32]], dtype=torch.int64)
    local_state = state_from_global(served.model, history, blobs[:1], fingerprint=served.fingerprint)
    remote_state = remote.state_from_global(served, prompt[:32], blobs[:1])
    assert remote_state.n_tokens == 32
    via_local = local.prefill(served, prompt[32:40], local_state, prompt_end=40)
    via_remote = remote.prefill(served, prompt[32:40], remote_state, prompt_end=40)
    assert via_remote.state is remote_state and remote_state.n_tokens == 40
    assert torch.equal(via_local.logits, via_remote.logits)
    with pytest.raises(CacheFormatError):
        remote.state_from_global(served, prompt[:40], blobs[:1])  # chunks end at 32, not 40
    with pytest.raises(TypeError, match="not a state of the model process"):
        remote.decode(served, 20, local_state)


def test_the_model_process_tunes_its_collector_unless_told_not_to(
    models: ModelRegistry, remote: ProcessCompute
) -> None:
    # torch's modules alone are far more than this (about 250,000 objects in the service's process)
    tuned = remote.stats()
    assert tuned["frozen_objects"] > 10_000
    assert tuned["gc_threshold"][0] == YOUNG_THRESHOLD
    plain = ProcessCompute.from_registry(models, threads=1, tune_gc=False)
    try:
        untouched = plain.stats()
        assert untouched["frozen_objects"] == 0
        assert untouched["gc_threshold"][0] == 700  # CPython's default
    finally:
        plain.close()


def test_a_full_hit_on_a_turn_end_snapshot_continues_as_the_import_path_here(
    models: ModelRegistry, remote: ProcessCompute
) -> None:
    """A turn end kept there (`export_windows_keeping`) and restored with its own windows for its own
    history takes the snapshot (no fill, no import); the state continues, by a prefill chunk and decode
    steps, bit for bit as the same history filled and imported here; windows that are not the snapshot's
    take the import there (refused here: they do not fit)."""
    served, local = models.get("a"), TorchCompute()
    seed, rng = _seeded()
    live_a, live_b, history = _lived_here_and_there(
        local, remote, served, rng, rng.randrange(20, 200), rng.randrange(1, 4)
    )
    windows, kept_a = export_windows_keeping(local, served, live_a, keep=True)
    windows_b, kept_b = export_windows_keeping(remote, served, live_b, keep=True)
    assert windows_b == windows and kept_a is not None and kept_b is not None
    taken = remote.stats()["snapshot_restores"]
    ca = clone_with_windows(local, served, restore_decoded(local, served, kept_a, history), windows)
    cb = clone_with_windows(remote, served, restore_decoded(remote, served, kept_b, history), windows)
    assert remote.stats()["snapshot_restores"] == taken + 1
    assert cb.n_tokens == ca.n_tokens == len(history)
    step = _prompt(rng, rng.randrange(1, 33))
    out_a, out_b = _continued_alike(local, remote, served, rng, (ca, cb), len(history), step, 3, seed)
    assert local.export_windows(served, out_a.state) == remote.export_windows(served, out_b.state)
    # the snapshot is not written by the turn that continued from it: a second full hit takes it again
    cb2 = clone_with_windows(remote, served, restore_decoded(remote, served, kept_b, history), windows)
    assert remote.stats()["snapshot_restores"] == taken + 2
    ca2 = clone_with_windows(local, served, restore_decoded(local, served, kept_a, history), windows)
    end = len(history) + len(step)
    again_a = local.prefill(served, step, ca2, prompt_end=end)
    again_b = remote.prefill(served, step, cb2, prompt_end=end)
    assert torch.equal(again_a.logits, again_b.logits), f"seed {seed}"
    # other windows: the import there, which refuses these as it would anyway
    with pytest.raises(CacheFormatError):
        clone_with_windows(remote, served, restore_decoded(remote, served, kept_b, history), windows[:-5])
    assert remote.stats()["snapshot_restores"] == taken + 2


def test_a_turn_end_takes_in_one_call_there_what_the_calls_give(
    models: ModelRegistry, remote: ProcessCompute
) -> None:
    """`export_turn_end` there (one call) against the calls one by one here, on a fresh random history
    and random chunk ranges from a random stored prefix: the same global-KV payloads by range, the same
    windows, and a kept state of the same history; no other call reaches the model process."""
    served, local = models.get("a"), TorchCompute()
    seed, rng = _seeded()
    live_a, live_b, history = _lived_here_and_there(
        local, remote, served, rng, rng.randrange(20, 200), rng.randrange(1, 4)
    )
    size = rng.choice((16, 32, 64))
    ranges = chunk_ranges(len(history), size, from_pos=rng.randrange(0, len(history)))
    before = dict(remote.stats()["ops"])
    there = export_turn_end(remote, served, live_b, ranges, keep=True)
    ops = remote.stats()["ops"]
    assert {op: n for op, (n, *_) in ops.items() if n != before.get(op, (0,))[0]} == {
        "export_turn_end": before.get("export_turn_end", (0,))[0] + 1,
        "stats": before.get("stats", (0,))[0] + 1,
    }, f"seed {seed}"
    here = export_turn_end(local, served, live_a, ranges, keep=True)
    want = {r: local.export_global(served, live_a, *r) for r in ranges}
    assert there.global_blobs == here.global_blobs == want, f"seed {seed}"
    assert there.windows == here.windows == local.export_windows(served, live_a)
    assert there.kept is not None and here.kept is not None and there.kept.usable
    assert there.kept.n_tokens == here.kept.n_tokens == len(history)
    # without keeping: nothing kept, the same payloads and windows
    bare = export_turn_end(remote, served, live_b, ranges[-1:], keep=False)
    assert bare.kept is None and bare.windows == there.windows
    assert bare.global_blobs == {ranges[-1]: want[ranges[-1]]}


def test_dropped_handles_are_freed_there(models: ModelRegistry, remote: ProcessCompute) -> None:
    served = models.get("a")
    gc.collect()  # handles of earlier tests caught in reference cycles go now, not during the count
    remote.held_states()
    before = remote.held_states()
    calls = remote.stats()["ops"].get("new_state", (0,))[0]
    handles = [remote.new_state(served) for _ in range(5)]
    assert remote.held_states() == before + 5
    # the model process's own accounting counts every call
    assert remote.stats()["ops"]["new_state"][0] == calls + 5
    del handles
    remote.held_states()  # the frees travel with the next call
    assert remote.held_states() == before


def test_kept_decoded_state_fills_as_in_process_compute(
    models: ModelRegistry, remote: ProcessCompute
) -> None:
    """`keep_decoded` / `fill_decoded` there against the same in this process, on a fresh random
    history: the filled states are then sealed, given the live state's windows and continued by a prefill
    chunk and decode steps, bit for bit alike; dropping the handle frees the kept tensors there."""
    served = models.get("a")
    local = TorchCompute()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    live_a, live_b, history = _lived_here_and_there(local, remote, served, rng, rng.randrange(40, 120), 1)
    gc.collect()
    before = remote.held_states()
    kept_a, kept_b = local.keep_decoded(served, live_a), remote.keep_decoded(served, live_b)
    assert kept_a is not None and kept_b is not None
    assert kept_b.usable and (kept_b.n_tokens, kept_b.nbytes) == (kept_a.n_tokens, kept_a.nbytes)
    assert remote.held_states() == before + 1
    windows = local.export_windows(served, live_a)
    assert windows == remote.export_windows(served, live_b)
    # a turn end's windows and kept state in one call there, as the two calls give them
    answered = remote.stats()["ops"].get("export_windows_keeping", (0,))[0]
    both, kept_both = export_windows_keeping(remote, served, live_b, keep=True)
    assert both == windows and kept_both is not None and kept_both.usable
    # with the decoded KV, a snapshot of the whole state: its bytes are all the storages the state pins
    # and the windows bytes kept with it
    assert kept_both.n_tokens == kept_a.n_tokens
    assert kept_both.nbytes == held_bytes(state_tensors(live_a)) + len(windows) > kept_a.nbytes
    assert export_windows_keeping(remote, served, live_b, keep=False) == (windows, None)
    assert export_windows_keeping(local, served, live_a, keep=False) == (windows, None)
    assert remote.stats()["ops"]["export_windows_keeping"][0] == answered + 2
    del kept_both
    gc.collect()
    a, b = local.new_state(served), remote.new_state(served)
    local.fill_decoded(served, a, kept_a)
    remote.fill_decoded(served, b, kept_b)
    for compute, state in ((local, a), (remote, b)):
        compute.seal_prefix(served, state, history)
        compute.import_windows(served, state, windows)
    assert b.n_tokens == a.n_tokens == len(history)
    step = _prompt(rng, rng.randrange(1, 9))
    _continued_alike(local, remote, served, rng, (a, b), len(history), step, 2, seed)
    with pytest.raises(TypeError, match="not kept by the model process"):
        remote.fill_decoded(served, remote.new_state(served), kept_a)
    # a full hit's state in one call there (`restore_with_windows`: the prefix restored straight into
    # the windowed state, the prefix itself pending), against the same steps one call at a time here
    calls = remote.stats()["ops"]
    ra, rb = restore_decoded(local, served, kept_a, history), restore_decoded(remote, served, kept_b, history)
    ca, cb = clone_with_windows(local, served, ra, windows), clone_with_windows(remote, served, rb, windows)
    after = remote.stats()["ops"]
    assert after["restore_with_windows"][0] == calls.get("restore_with_windows", (0,))[0] + 1
    for op in ("restore_decoded", "clone_with_windows", "new_state", "fill_decoded", "seal_prefix", "clone",
               "import_windows"):  # fmt: skip
        assert after.get(op, (0,))[0] == calls.get(op, (0,))[0], op
    assert rb.pending is not None and rb.state_id is None and rb.n_tokens == len(history)
    assert cb.state_id is not None and cb.n_tokens == ca.n_tokens == len(history)
    out_a = local.prefill(served, step, ca, prompt_end=len(history) + len(step))
    out_b = remote.prefill(served, step, cb, prompt_end=len(history) + len(step))
    assert torch.equal(out_a.logits, out_b.logits), f"seed {seed}"
    # windows that do not fit: nothing is kept there, and the prefix stays pending
    gc.collect()
    remote.held_states()  # frees of handles gone so far travel with it
    held = remote.held_states()
    with pytest.raises(CacheFormatError):
        clone_with_windows(remote, served, rb, windows[:-5])
    assert remote.held_states() == held and rb.pending is not None
    # the prefix state keeps no windows: a global-only replay from it (restored there by this first call
    # that names it, once) equals here and there
    out_a = local.prefill(served, step, ra, prompt_end=len(history) + len(step))
    out_b = remote.prefill(served, step, rb, prompt_end=len(history) + len(step))
    assert out_a.stats == out_b.stats and torch.equal(out_a.logits, out_b.logits), f"seed {seed}"
    assert rb.pending is None and remote.stats()["ops"]["restore_decoded"][0] == calls.get(
        "restore_decoded", (0,)
    )[0] + 1
    gc.collect()
    remote.held_states()
    held = remote.held_states()
    with pytest.raises(CacheFormatError):
        clone_with_windows(remote, served, rb, windows[:-5])
    assert remote.held_states() == held  # the refused copy is not kept there
    gc.collect()
    remote.held_states()
    holding = remote.held_states()
    del kept_b
    remote.held_states()  # the free travels with the next call
    assert remote.held_states() == holding - 1


def test_kept_decoded_state_of_an_ended_model_process_is_unusable(models: ModelRegistry) -> None:
    served = models.get("a")
    compute = ProcessCompute.from_registry(models, threads=1)
    try:
        state = compute.prefill(served, [20, 21, 22, 23], None, prompt_end=4).state
        kept = compute.keep_decoded(served, state)
        assert kept is not None and kept.usable
        os.kill(compute._proc.proc.pid, signal.SIGKILL)  # noqa: SLF001 - the test kills it
        with pytest.raises(ModelProcessError):
            compute.decode(served, 24, state)
        assert not kept.usable  # a full hit then misses it and imports the chunks
        fresh = compute.new_state(served)  # a new model process
        assert not kept.usable
        with pytest.raises(ModelProcessError, match="earlier model process"):
            compute.fill_decoded(served, fresh, kept)
    finally:
        compute.close()


def test_a_model_process_started_with_python_m_computes_as_a_preloaded_one(
    models: ModelRegistry, remote: ProcessCompute
) -> None:
    """`child_start = "exec"` against the default (forked from a launcher, orchestrator/child_launcher.py):
    the same passes and exports on fresh random prompts."""
    served = models.get("a")
    executed = ProcessCompute.from_registry(models, threads=1, child_start="exec")
    try:
        seed, rng = _seeded()
        for _ in range(2):
            prompt = _prompt(rng, rng.randrange(5, 70))
            a = executed.prefill(served, prompt, None, prompt_end=len(prompt))
            b = remote.prefill(served, prompt, None, prompt_end=len(prompt))
            assert torch.equal(a.logits, b.logits) and a.stats == b.stats, f"seed {seed}"
            token = rng.randrange(16, 512)
            a, b = executed.decode(served, token, a.state), remote.decode(served, token, b.state)
            assert torch.equal(a.logits, b.logits), f"seed {seed}"
            n = a.state.n_tokens
            theirs = remote.export_global(served, b.state, 0, n)
            assert executed.export_global(served, a.state, 0, n) == theirs, f"seed {seed}"
        assert isinstance(executed._proc.proc, subprocess.Popen)  # noqa: SLF001 - how each one started
        assert isinstance(remote._proc.proc, LaunchedChild)  # noqa: SLF001
    finally:
        executed.close()


def test_a_model_process_under_another_fingerprint_is_refused(models: ModelRegistry) -> None:
    other = ProcessCompute(
        specs={"a": ServedModelSpec(name="a", config="v41-tiny", seed=2)}, cpu_path=models.cpu_path
    )
    try:
        with pytest.raises(ModelProcessError, match="fingerprint"):
            other.new_state(models.get("a"))
    finally:
        other.close()


def test_the_death_of_the_model_process_fails_its_states_and_the_next_call_restarts(
    models: ModelRegistry,
) -> None:
    served = models.get("a")
    compute = ProcessCompute.from_registry(models, threads=1)
    try:
        state = compute.prefill(served, [20, 21, 22], None, prompt_end=3).state
        pid = compute._proc.proc.pid  # noqa: SLF001 - the test kills it
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ModelProcessError):
            compute.decode(served, 23, state)
        with pytest.raises(ModelProcessError, match="earlier model process"):
            compute.decode(served, 23, state)
        out = compute.prefill(served, [20, 21, 22], None, prompt_end=3)
        assert out.state.n_tokens == 3 and compute._proc.proc.pid != pid  # noqa: SLF001
    finally:
        compute.close()


def test_the_model_process_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from model import configure_torch
        from orchestrator.engine import ModelRegistry, ServedModelSpec
        from orchestrator.model_process import ProcessCompute
        reg = ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)})
        configure_torch(reg.cpu_path)
        compute = ProcessCompute.from_registry(reg)
        compute.new_state(reg.get("a"))
        print(compute._proc.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        while line and not line.strip().isdigit():  # log lines before it
            line = parent.stdout.readline()
        child = int(line)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process_alive(child):
            time.sleep(0.1)
        assert not process_alive(child), "the model process outlived its killed parent"
    finally:
        parent.kill()


def test_callers_waiting_for_a_connection_wake_when_the_model_process_dies(models: ModelRegistry) -> None:
    """One connection, two threads calling in a loop: when the model process is killed, the call in
    flight fails with ModelProcessError and a caller waiting for the connection wakes (fails, or goes on
    in the next model process); none hangs."""
    served = models.get("a")
    compute = ProcessCompute.from_registry(models, threads=1, connections=1)
    errors: list[BaseException] = []
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            try:
                compute.prefill(served, list(range(16, 216)), None, prompt_end=200)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)
                return

    try:
        compute.new_state(served)
        pid = compute._proc.proc.pid  # noqa: SLF001 - the test kills it
        threads = [threading.Thread(target=caller, daemon=True) for _ in range(2)]
        for th in threads:
            th.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        stop.set()
        for th in threads:
            th.join(timeout=30)
        assert not any(th.is_alive() for th in threads), "a caller hung after the model process died"
        assert errors and all(isinstance(e, ModelProcessError) for e in errors), errors
    finally:
        compute.close()


def test_the_model_process_loads_its_models_outside_inference_mode(models: ModelRegistry) -> None:
    """The worker serves under `torch.inference_mode()`, but loads its models outside it: weights made
    inside it are inference tensors (no version counter), and a Linear then caches neither its packed
    bf16 weight nor its decoded FP8/FP4 one, redoing that work on every call (a third of the bf16
    linears' time in a 64-session load run, session 18)."""
    from model.linear import Linear
    from orchestrator.model_process.worker import WorkerConfig, _Worker

    compute = ProcessCompute.from_registry(models, threads=1)
    threads = torch.get_num_threads()
    try:
        worker = _Worker(WorkerConfig(authkey=b"k" * 32, **compute._config_args))
        with torch.inference_mode():
            served = worker._served("a")
            linears = [m for m in served.model.modules() if isinstance(m, Linear)]
            assert linears and not any(m.weight.is_inference() for m in linears)
            plain = [m for m in linears if not m.quantized]
            quantized = [m for m in linears if m.quantized]
            assert plain and plain[0]._packed_bf16() is plain[0]._packed_bf16()
            if quantized:
                assert quantized[0].prepared_weight() is quantized[0].prepared_weight()
    finally:
        torch.set_num_threads(threads)
        compute.close()
