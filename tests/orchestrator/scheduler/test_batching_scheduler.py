"""The batching scheduler over a recording stand-in compute: what each step takes (every waiting decode
in one batch, prefill chunks under the token budget), fair order across tenants, failure isolation,
admission control. Exactness over the real model is in tests/orchestrator/test_e2e_batching.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from orchestrator.api import ResourceExhaustedError
from orchestrator.scheduler import BatchingScheduler, FairOrder, PassRequest, SerialScheduler, WorkOwner


@dataclass(frozen=True)
class Served:
    name: str = "m"


@dataclass
class Recorder:
    """Runs nothing: records each call, and can block the loop until released."""

    steps: list[tuple[str, list]] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    fail_token: int | None = None

    def __post_init__(self) -> None:
        self.gate.set()

    def prefill(self, served, tokens: Sequence[int], state, *, prompt_end: int):
        self.gate.wait()
        self.steps.append(("prefill", list(tokens)))
        return ("prefilled", list(tokens))

    def decode(self, served, token: int, state):
        if token == self.fail_token:
            raise ValueError(f"bad token {token}")
        self.steps.append(("decode", [token]))
        return ("decoded", token)

    def decode_many(self, served, tokens: Sequence[int], states):
        self.gate.wait()
        if self.fail_token in tokens:
            raise ValueError(f"bad token {self.fail_token}")
        self.steps.append(("decode_many", list(tokens)))
        return [("decoded", t) for t in tokens]


def _owner(t: str, s: str) -> WorkOwner:
    return WorkOwner(tenant_id=t, session_id=s)


def _blocker(sched):
    # the first request: it holds the loop inside its pass until the recorder's gate opens
    return sched.prefill(Served(), [0], None, prompt_end=1, owner=_owner("a", "0"))


def _in_threads(calls) -> tuple[list[threading.Thread], list]:
    results: list = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for th in threads:
        th.start()
    return threads, results


def test_waiting_decodes_share_one_step_and_prefill_respects_the_budget() -> None:
    rec = Recorder()
    sched = BatchingScheduler(rec, max_batch_sequences=3, step_token_budget=10)
    try:
        rec.gate.clear()
        # the first request occupies the loop (blocked in its pass) while the others queue up
        first, _ = _in_threads([lambda: _blocker(sched)])
        time.sleep(0.2)
        calls = [
            (lambda i=i: sched.decode(Served(), 100 + i, object(), owner=_owner("a", f"d{i}")))
            for i in range(5)
        ]
        calls += [
            lambda: sched.prefill(Served(), [1] * 4, None, prompt_end=4, owner=_owner("b", "p1")),
            lambda: sched.prefill(Served(), [2] * 4, None, prompt_end=4, owner=_owner("c", "p2")),
        ]
        threads, results = _in_threads(calls)
        time.sleep(0.3)
        rec.gate.set()
        for th in first + threads:
            th.join(timeout=10)
        assert results[:5] == [("decoded", 100 + i) for i in range(5)]
        steps = rec.steps[1:]
        # step 2: three decodes (the cap), then prefill chunks while budget 10 - 3 lasts (one of 4 rows)
        assert steps[0][0] == "decode_many" and len(steps[0][1]) == 3
        assert [k for k, _ in steps[1:]].count("prefill") == 2
        assert sorted(t for k, ts in rec.steps if k == "decode_many" for t in ts) == [100, 101, 102, 103, 104]
    finally:
        sched.close()


def test_fair_order_is_round_robin_over_tenants_then_sessions() -> None:
    order = FairOrder()

    def req(t, s, seq):
        return PassRequest(owner=_owner(t, s), served=Served(), state=None, seq=seq, enqueued_at=0, token=1)

    big = [req("big", f"s{i}", i) for i in range(4)]
    small = req("small", "x", 10)
    ranked = order.rank([*big, small])
    # a tenant never served comes before anyone else's second request; arrival breaks ties
    order.served(ranked[:1], step=1)
    ranked = order.rank([*big[1:], small])
    assert ranked[0] is small
    order.served([small], step=2)
    order.served(big[1:2], step=3)
    assert order.rank([big[1], big[2]])[0] is big[2]


def test_a_failing_sequence_does_not_fail_its_batch() -> None:
    rec = Recorder(fail_token=13)
    sched = BatchingScheduler(rec, max_batch_sequences=8)
    try:
        rec.gate.clear()
        first, _ = _in_threads([lambda: _blocker(sched)])
        time.sleep(0.2)
        calls = [
            (lambda t=t: sched.decode(Served(), t, object(), owner=_owner("a", str(t)))) for t in (12, 13, 14)
        ]
        threads, results = _in_threads(calls)
        time.sleep(0.3)
        rec.gate.set()
        for th in first + threads:
            th.join(timeout=10)
        assert results[0] == ("decoded", 12) and results[2] == ("decoded", 14)
        assert isinstance(results[1], ValueError) and "13" in str(results[1])
    finally:
        sched.close()


@pytest.mark.parametrize("kind", [BatchingScheduler, SerialScheduler])
def test_admission_refuses_past_the_limit_with_a_retry_hint(kind) -> None:
    sched = kind(Recorder(), max_running_turns=2)
    try:
        with sched.admit("m", _owner("a", "1")), sched.admit("m", _owner("a", "2")):
            with pytest.raises(ResourceExhaustedError) as info, sched.admit("m", _owner("a", "3")):
                pass
            assert info.value.reason == "CAPACITY" and info.value.retry_after_s > 0
            # another model has its own bound
            with sched.admit("other", _owner("a", "4")):
                pass
        with sched.admit("m", _owner("a", "5")):
            assert sched.running("m") == 1
    finally:
        sched.close()


def test_decode_without_a_state_is_refused() -> None:
    sched = BatchingScheduler(Recorder())
    try:
        with pytest.raises(ValueError, match="state"):
            sched.decode(Served(), 1, None, owner=_owner("a", "1"))
    finally:
        sched.close()


def test_finished_turns_leave_the_fair_order() -> None:
    rec = Recorder()
    sched = BatchingScheduler(rec)
    try:
        for i in range(5):
            owner = _owner("a", str(i))
            with sched.admit("m", owner):
                sched.decode(Served(), 1, object(), owner=owner)
        assert len(sched._loops["m"]._order) == 0
    finally:
        sched.close()


@dataclass
class ManyRecorder(Recorder):
    """A recorder with a batched prefill; a chunk holding `fail_token` fails it (and its lone prefill)."""

    def prefill(self, served, tokens: Sequence[int], state, *, prompt_end: int):
        if self.fail_token in tokens:
            raise ValueError(f"bad chunk {list(tokens)}")
        return super().prefill(served, tokens, state, prompt_end=prompt_end)

    def prefill_many(self, served, chunks, states, prompt_ends):
        self.gate.wait()
        if any(self.fail_token in c for c in chunks):
            raise ValueError(f"bad token {self.fail_token}")
        self.steps.append(("prefill_many", [list(c) for c in chunks]))
        return [("prefilled", list(c)) for c in chunks]


@pytest.mark.parametrize("fail", [None, 7])
def test_a_steps_prefill_chunks_share_one_prefill_many_and_a_failure_runs_each_alone(fail) -> None:
    rec = ManyRecorder(fail_token=fail)
    sched = BatchingScheduler(rec, max_batch_sequences=8, step_token_budget=16)
    try:
        rec.gate.clear()
        first, _ = _in_threads([lambda: _blocker(sched)])
        time.sleep(0.2)
        chunks = [[5] * 3, [6] * 4, [7] * 2]
        calls = [
            (lambda c=c, i=i: sched.prefill(Served(), c, None, prompt_end=len(c), owner=_owner(str(i), "p")))
            for i, c in enumerate(chunks)
        ]
        threads, results = _in_threads(calls)
        time.sleep(0.3)
        rec.gate.set()
        for th in first + threads:
            th.join(timeout=10)
        if fail is None:
            assert results == [("prefilled", c) for c in chunks]
            assert rec.steps[1][0] == "prefill_many" and sorted(rec.steps[1][1]) == sorted(chunks)
        else:
            # the failing chunk gets its own error; the others their lone prefill's result
            assert results[:2] == [("prefilled", c) for c in chunks[:2]]
            assert isinstance(results[2], ValueError) and "7" in str(results[2])
            assert [k for k, _ in rec.steps[1:]] == ["prefill", "prefill"]
    finally:
        sched.close()


def test_an_idle_loop_runs_the_pass_in_the_asking_thread_and_queued_ones_in_one_step() -> None:
    threads: list[str] = []

    class Where(Recorder):
        def decode_many(self, served, tokens, states):
            threads.append(threading.current_thread().name)
            return super().decode_many(served, tokens, states)

        def prefill(self, served, tokens, state, *, prompt_end):
            threads.append(threading.current_thread().name)
            return super().prefill(served, tokens, state, prompt_end=prompt_end)

    rec = Where()
    sched = BatchingScheduler(rec, max_batch_sequences=8, step_token_budget=16)
    try:
        # nothing runs or waits: the asking thread runs its own pass (no handoff to the loop)
        assert sched.decode(Served(), 7, object(), owner=_owner("a", "s")) == ("decoded", 7)
        assert threads == [threading.current_thread().name]
        rec.gate.clear()
        first, results0 = _in_threads([lambda: _blocker(sched)])
        time.sleep(0.2)
        # the blocker's step runs inline in its own thread; these wait for it, then share one loop step
        calls = [
            (lambda i=i: sched.decode(Served(), 10 + i, object(), owner=_owner("a", f"d{i}")))
            for i in range(3)
        ]
        waiting, results = _in_threads(calls)
        time.sleep(0.3)
        assert len(rec.steps) == 1  # only the first decode so far; the blocker is held at the gate
        rec.gate.set()
        for th in first + waiting:
            th.join(timeout=10)
        assert results0 == [("prefilled", [0])] and results == [("decoded", 10 + i) for i in range(3)]
        assert rec.steps[1] == ("prefill", [0]) and len(rec.steps) == 3
        assert rec.steps[2][0] == "decode_many" and sorted(rec.steps[2][1]) == [10, 11, 12]
        assert threads[1] == first[0].name and threads[2] == "kvresume-step-m"
    finally:
        sched.close()


@dataclass
class Timed(Recorder):
    """A Recorder that also notes when each pass ended (prefill) or began (decode_many)."""

    times: list[tuple[str, float]] = field(default_factory=list)

    def prefill(self, served, tokens: Sequence[int], state, *, prompt_end: int):
        out = super().prefill(served, tokens, state, prompt_end=prompt_end)
        self.times.append(("prefill_end", time.perf_counter()))
        return out

    def decode_many(self, served, tokens: Sequence[int], states):
        self.times.append(("decode_start", time.perf_counter()))
        return super().decode_many(served, tokens, states)


def _prompt_then_decode(sched, rec: Recorder, *, follows: bool):
    """Turn x: a prompt chunk that says a decode follows (it blocks in the recorder's gate); turn y: a
    decode queued meanwhile. With `follows`, x asks for its decode 0.1 s after its chunk returns (what a
    turn does in between: sample, stream the token)."""

    def x():
        owner = _owner("a", "x")
        sched.submit_prefill(Served(), [7], None, prompt_end=1, owner=owner, follow_up=True).result()
        if follows:
            time.sleep(0.1)
            sched.decode(Served(), 55, object(), owner=owner)

    rec.gate.clear()
    threads, _ = _in_threads([x])
    time.sleep(0.2)
    more, results = _in_threads([lambda: sched.decode(Served(), 44, object(), owner=_owner("b", "y"))])
    time.sleep(0.2)
    rec.gate.set()
    for th in threads + more:
        th.join(timeout=10)
    return results


def test_the_step_after_a_prompt_waits_for_the_turns_that_said_they_would_ask_again(monkeypatch) -> None:
    """A turn whose prompt chunk ran in the last step asks for its first decode moments later: the next
    step waits for it (`follow_up`), so both decodes share one step instead of x missing it."""
    import orchestrator.scheduler.batching as batching

    monkeypatch.setattr(batching, "FOLLOW_UP_WAIT_MAX_S", 2.0)  # room for a slow machine's thread switch
    monkeypatch.setattr(batching, "FOLLOW_UP_WAIT_FRACTION", 10.0)
    rec = Recorder()
    sched = BatchingScheduler(rec)
    try:
        assert _prompt_then_decode(sched, rec, follows=True) == [("decoded", 44)]
        decodes = [ts for kind, ts in rec.steps if kind == "decode_many"]
        assert decodes == [[55, 44]] or decodes == [[44, 55]], rec.steps
    finally:
        sched.close()


def test_the_wait_for_follow_ups_is_bounded(monkeypatch) -> None:
    """A turn that said it would ask again and does not (a stop token, a failure) holds the next step
    only until the wait's deadline: a fraction of the last step, at most FOLLOW_UP_WAIT_MAX_S."""
    import orchestrator.scheduler.batching as batching

    monkeypatch.setattr(batching, "FOLLOW_UP_WAIT_MAX_S", 0.3)
    monkeypatch.setattr(batching, "FOLLOW_UP_WAIT_FRACTION", 10.0)
    rec = Timed()
    sched = BatchingScheduler(rec)
    try:
        assert _prompt_then_decode(sched, rec, follows=False) == [("decoded", 44)]
        ended = next(t for kind, t in rec.times if kind == "prefill_end")
        started = next(t for kind, t in rec.times if kind == "decode_start")
        assert 0.25 <= started - ended < 3.0, started - ended
    finally:
        sched.close()


def test_prompt_chunks_that_come_during_a_decode_pass_join_that_steps_prefill_pass() -> None:
    in_decode, decode_gate = threading.Event(), threading.Event()
    prefill_steps: list[tuple[list, int]] = []  # (tokens, the loop's step) of each prefill

    class Held(Recorder):
        def decode_many(self, served, tokens, states):
            in_decode.set()
            decode_gate.wait()
            return super().decode_many(served, tokens, states)

        def prefill(self, served, tokens, state, *, prompt_end):
            out = super().prefill(served, tokens, state, prompt_end=prompt_end)
            prefill_steps.append((list(tokens), loop._step))  # noqa: SLF001 - which step ran it
            return out

    rec = Held()
    sched = BatchingScheduler(rec, max_batch_sequences=8, step_token_budget=10)
    try:
        rec.gate.clear()
        # the blocker's step runs in its own thread; the decode queued meanwhile is the loop's next step
        first, _ = _in_threads([lambda: _blocker(sched)])
        time.sleep(0.2)
        loop = sched._loops["m"]  # noqa: SLF001 - the loop's queue and steps are what this checks
        decoding, decoded = _in_threads([lambda: sched.decode(Served(), 5, object(), owner=_owner("a", "d"))])
        time.sleep(0.2)
        rec.gate.set()
        assert in_decode.wait(timeout=5) and loop.waiting() == 0
        # two 5-row chunks come in during that decode pass: its step's budget has 10 - 1 rows left for them
        calls = [
            (lambda i=i: sched.prefill(Served(), [i] * 5, None, prompt_end=5, owner=_owner(f"t{i}", "p")))
            for i in (1, 2)
        ]
        waiting, prefilled = _in_threads(calls)
        deadline = time.monotonic() + 5
        while loop.waiting() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.waiting() == 2
        decode_gate.set()
        for th in first + decoding + waiting:
            th.join(timeout=10)
        assert decoded == [("decoded", 5)]
        assert sorted(prefilled) == [("prefilled", [1] * 5), ("prefilled", [2] * 5)]
        # the chunk that fit what was left of the budget ran in the decode's step, after its decode pass;
        # the other waited for the next step
        assert [kind for kind, _ in rec.steps] == ["prefill", "decode_many", "prefill", "prefill"]
        (_, blocker_step), (_, joined), (_, next_one) = prefill_steps
        assert joined == blocker_step + 1 and next_one == joined + 1
    finally:
        sched.close()
