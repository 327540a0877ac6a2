"""Decode chains (orchestrator/scheduler/chains.py): the scheduler samples each token of a turn as its pass
ends and queues that token's decode itself, over a stand-in compute whose logits are plain ints (the
sampler here: logits + 1). What the real model's turns get under chains is in the e2e suites
(test_e2e_batching.py compares batching with serial sessions token for token; test_e2e_errors.py keeps a
partial turn after an Abort)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from orchestrator.scheduler import BatchingScheduler, Continued, DecodeChain, SerialScheduler, WorkOwner


@dataclass(frozen=True)
class Served:
    name: str = "m"


@dataclass(frozen=True)
class Out:
    logits: int
    state: object


@dataclass
class IntCompute:
    """A compute whose logits are ints: a prompt's is its last token, a decode's is its token. Records
    each pass with the thread that ran it; `gate` holds decode passes until set."""

    passes: list[tuple[str, list[int], str]] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    prefill_gate: threading.Event = field(default_factory=threading.Event)
    in_prefill: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.gate.set()
        self.prefill_gate.set()

    def _ran(self, kind: str, tokens: Sequence[int]) -> None:
        self.passes.append((kind, list(tokens), threading.current_thread().name))

    def prefill(self, served, tokens: Sequence[int], state, *, prompt_end: int):
        self.in_prefill.set()
        self.prefill_gate.wait()
        self._ran("prefill", tokens)
        return Out(logits=tokens[-1], state=state)

    def decode(self, served, token: int, state):
        self.gate.wait()
        self._ran("decode", [token])
        return Out(logits=token, state=state)

    def decode_many(self, served, tokens: Sequence[int], states):
        self.gate.wait()
        self._ran("decode_many", tokens)
        return [Out(logits=t, state=s) for t, s in zip(tokens, states, strict=True)]


def _owner(s: str = "s") -> WorkOwner:
    return WorkOwner(tenant_id="t", session_id=s)


def _chain(max_new: int, *, persist: bool, stops: Sequence[int] = ()) -> DecodeChain:
    return DecodeChain(lambda logits: logits + 1, stops=stops, max_new_tokens=max_new, persist=persist)


def _follow(sched, first: Future, owner: WorkOwner | None = None) -> tuple[list[int], object, int]:
    """Play the turn from its prompt's future on: the chain's tokens, following the decodes the scheduler
    queued and submitting those it left to the turn (as the turn engine does); what the last decode gave
    (a bare output: nothing is sampled after it) or None; and how many decodes the turn submitted."""
    owner = owner or _owner()
    got = first.result(timeout=10)
    tokens, submitted = [], 0
    while True:
        assert isinstance(got, Continued)
        tokens.append(got.token)
        if not got.decode:
            return tokens, None, submitted
        if got.next is None:
            submitted += 1
            pending = sched.submit_decode(Served(), got.token, got.output.state, owner=owner, chain=got.then)
        else:
            pending = got.next
        after = pending.result(timeout=10)
        if not isinstance(after, Continued):
            return tokens, after, submitted
        got = after


def _hold_loop(sched, compute: IntCompute) -> threading.Thread:
    """A prompt without a chain that holds the loop inside its prefill (run in its own thread) until
    `compute.prefill_gate` is set: requests submitted meanwhile are the loop's, not run inline."""
    compute.prefill_gate.clear()
    compute.in_prefill.clear()
    blocker = threading.Thread(
        target=lambda: sched.submit_prefill(Served(), [0], object(), prompt_end=1, owner=_owner("b"))
    )
    blocker.start()
    while not compute.in_prefill.wait(0.01):
        pass
    return blocker


@pytest.fixture
def batching():
    compute = IntCompute()
    sched = BatchingScheduler(compute)
    yield sched, compute
    sched.close()


def test_a_chain_samples_each_token_and_queues_its_decode_without_the_turn_asking(batching) -> None:
    sched, compute = batching
    blocker = _hold_loop(sched, compute)
    chain = _chain(4, persist=True)
    first = sched.submit_prefill(Served(), [3, 5], object(), prompt_end=2, owner=_owner(), chain=chain)
    compute.prefill_gate.set()
    blocker.join(timeout=10)
    tokens, last, submitted = _follow(sched, first)
    assert tokens == [6, 7, 8, 9] and chain.sampled == 4 and submitted == 0
    # a persisted turn decodes its last token too, and samples nothing after it
    assert isinstance(last, Out) and last.logits == 9
    decodes = [(toks, thread) for kind, toks, thread in compute.passes if kind == "decode_many"]
    assert [toks for toks, _ in decodes] == [[6], [7], [8], [9]]
    # the step loop ran every decode: the asking thread only submitted the prompt
    assert all(thread == "kvresume-step-m" for _, thread in decodes), decodes


def test_an_idle_loop_leaves_each_decode_to_the_turn_which_runs_it_inline(batching) -> None:
    sched, compute = batching
    first = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner(),
                                 chain=_chain(3, persist=True))  # fmt: skip
    tokens, last, submitted = _follow(sched, first)
    assert tokens == [6, 7, 8] and isinstance(last, Out) and last.logits == 8 and submitted == 3
    # one session alone: every pass ran in the asking thread, none queued for the loop
    here = threading.current_thread().name
    assert [(kind, toks, thread) for kind, toks, thread in compute.passes] == [
        ("prefill", [5], here), ("decode_many", [6], here), ("decode_many", [7], here),
        ("decode_many", [8], here)
    ]


def test_a_chain_that_is_not_persisted_leaves_its_last_token_undecoded(batching) -> None:
    sched, compute = batching
    first = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner(),
                                 chain=_chain(3, persist=False))  # fmt: skip
    tokens, last, _ = _follow(sched, first)
    assert tokens == [6, 7, 8] and last is None
    assert [toks for kind, toks, _ in compute.passes if kind == "decode_many"] == [[6], [7]]


@pytest.mark.parametrize("persist", [True, False])
def test_a_stop_token_ends_the_chain(batching, persist) -> None:
    sched, compute = batching
    first = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner(),
                                 chain=_chain(10, persist=persist, stops=[8]))  # fmt: skip
    tokens, last, _ = _follow(sched, first)
    assert tokens == [6, 7, 8]
    decoded = [toks for kind, toks, _ in compute.passes if kind == "decode_many"]
    assert decoded == ([[6], [7], [8]] if persist else [[6], [7]])
    assert (last is not None) == persist


def test_chains_of_several_turns_share_their_steps(batching) -> None:
    sched, compute = batching
    blocker = _hold_loop(sched, compute)
    # three turns' prompts queue while the loop is held: one step prefills them, then each step decodes
    # all three, without any turn asking
    firsts = [sched.submit_prefill(Served(), [10 * i], object(), prompt_end=1, owner=_owner(f"s{i}"),
                                   chain=_chain(3, persist=True)) for i in (1, 2, 3)]  # fmt: skip
    compute.prefill_gate.set()
    blocker.join(timeout=10)
    followed = [_follow(sched, f, _owner(f"s{i}")) for i, f in zip((1, 2, 3), firsts, strict=True)]
    assert [(tokens, submitted) for tokens, _, submitted in followed] == [
        ([11, 12, 13], 0), ([21, 22, 23], 0), ([31, 32, 33], 0)
    ]
    steps = [toks for kind, toks, _ in compute.passes if kind == "decode_many"]
    assert steps == [[11, 21, 31], [12, 22, 32], [13, 23, 33]]


def test_a_halted_chain_samples_nothing_more(batching) -> None:
    sched, compute = batching
    blocker = _hold_loop(sched, compute)
    chain = _chain(10, persist=True)
    first = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner(), chain=chain)
    compute.gate.clear()  # the loop will wait inside the decode of 6
    compute.prefill_gate.set()
    blocker.join(timeout=10)
    got = first.result(timeout=10)
    assert got.token == 6 and got.next is not None
    chain.halt()
    compute.gate.set()
    after = got.next.result(timeout=10)
    # the decode that was queued still ran (the turn's state covers the token it streamed) ...
    assert isinstance(after, Continued) and after.output.logits == 6
    # ... and nothing was sampled or queued after it
    assert after.token is None and after.next is None and chain.sampled == 1
    assert [toks for kind, toks, _ in compute.passes if kind == "decode_many"] == [[6]]


def test_a_sampler_that_fails_fails_that_turns_pass_alone(batching) -> None:
    sched, compute = batching

    def bad(logits: int) -> int:
        raise ValueError(f"cannot sample from {logits}")

    bad_chain = DecodeChain(bad, stops=(), max_new_tokens=3, persist=True)
    failing = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner("a"), chain=bad_chain)
    with pytest.raises(ValueError, match="cannot sample from 5"):
        failing.result(timeout=10)
    fine = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner("b"),
                                chain=_chain(2, persist=False))  # fmt: skip
    assert _follow(sched, fine)[0] == [6, 7]


def test_the_serial_scheduler_samples_in_the_asking_thread_and_queues_nothing() -> None:
    compute = IntCompute()
    sched = SerialScheduler(compute)
    chain = _chain(3, persist=True)
    got = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner(), chain=chain).result()
    tokens = []
    while isinstance(got, Continued):
        tokens.append(got.token)
        assert got.next is None  # the turn submits each decode itself, continuing the chain
        if not got.decode:
            break
        asked = sched.submit_decode(Served(), got.token, got.output.state, owner=_owner(), chain=got.then)
        got = asked.result()
    assert tokens == [6, 7, 8] and isinstance(got, Out) and got.logits == 8
    here = threading.current_thread().name
    assert [(kind, toks) for kind, toks, _ in compute.passes] == [
        ("prefill", [5]), ("decode", [6]), ("decode", [7]), ("decode", [8])
    ]
    assert all(thread == here for _, _, thread in compute.passes)


def test_a_chain_refuses_a_turn_that_generates_nothing() -> None:
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        DecodeChain(lambda logits: 0, stops=(), max_new_tokens=0, persist=False)


class SentApart(IntCompute):
    """A compute that can send a prefill pass and wait for it apart (as the model process does), and
    records when each happens against the samples taken; `fail` makes the send or the wait raise."""

    def __init__(self, events: list[str], fail: str | None = None) -> None:
        super().__init__()
        self.events = events
        self.fail = fail

    def decode_many(self, served, tokens, states):
        self.events.append(f"decode {list(tokens)}")
        return super().decode_many(served, tokens, states)

    def start_prefill_many(self, served, chunks, states, prompt_ends, logits=None):
        # (`logits`: what of each output's logits the chains read; these outputs are ints anyway)
        if self.fail == "send":
            raise ValueError("send failed")
        self.events.append(f"prefill sent {[list(c) for c in chunks]}")

        def outputs():
            if self.fail == "wait":
                raise ValueError("wait failed")
            self.events.append("prefill done")
            return [Out(logits=c[-1], state=s) for c, s in zip(chunks, states, strict=True)]

        return outputs


@pytest.mark.parametrize("fail", [None, "send", "wait"])
def test_a_steps_prefill_pass_goes_out_before_its_decode_chains_are_sampled(fail) -> None:
    events: list[str] = []
    compute = SentApart(events, fail)
    sched = BatchingScheduler(compute)

    def sample(logits: int) -> int:
        events.append(f"sampled {logits}")
        return logits + 1

    try:
        blocker = _hold_loop(sched, compute)
        first = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner("a"),
                                     chain=DecodeChain(sample, stops=(), max_new_tokens=2, persist=False))
        compute.gate.clear()  # the loop's step of the chain's first decode waits inside that pass ...
        compute.prefill_gate.set()
        blocker.join(timeout=10)
        deadline = time.monotonic() + 10
        while "decode [6]" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        # ... while two prompts (no chains) come in: they join that step's prefill pass
        prompts = [sched.submit_prefill(Served(), [p], object(), prompt_end=1, owner=_owner(f"p{p}"))
                   for p in (20, 30)]  # fmt: skip
        compute.gate.set()
        assert [p.result(timeout=10).logits for p in prompts] == [20, 30]
        assert _follow(sched, first)[0] == [6, 7]
    finally:
        sched.close()
    step = events[events.index("decode [6]"):]
    if fail is None:
        # the decode pass, then the prefill pass sent, then the decode's chain sampled, then the prefill
        # waited for
        assert step[:4] == ["decode [6]", "prefill sent [[20], [30]]", "sampled 6", "prefill done"], events
    else:
        # a send or a wait that fails runs each chunk alone (`prefill`), after the chain was sampled
        sent = ["prefill sent [[20], [30]]"] if fail == "wait" else []
        assert "prefill done" not in events and step[:3] == ["decode [6]", *sent, "sampled 6"][:3], events
        assert [(kind, toks) for kind, toks, _ in compute.passes if kind == "prefill"][-2:] == [
            ("prefill", [20]), ("prefill", [30])
        ]


class DecodesApart(SentApart):
    """SentApart that sends its decode passes apart too."""

    def start_decode_many(self, served, tokens, states, logits=None):
        self.events.append(f"decode sent {list(tokens)}")

        def outputs():
            self.events.append("decode done")
            return [Out(logits=t, state=s) for t, s in zip(tokens, states, strict=True)]

        return outputs


def test_a_steps_prompt_results_go_out_once_the_next_decode_pass_is_sent() -> None:
    events: list[str] = []
    compute = DecodesApart(events)
    sched = BatchingScheduler(compute)
    try:
        blocker = _hold_loop(sched, compute)
        chained = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner("a"),
                                       chain=_chain(2, persist=False))  # fmt: skip
        plain = sched.submit_prefill(Served(), [20], object(), prompt_end=1, owner=_owner("b"))
        for name, future in (("chained", chained), ("plain", plain)):
            future.add_done_callback(lambda _, name=name: events.append(f"published {name}"))
        compute.prefill_gate.set()
        blocker.join(timeout=10)
        assert plain.result(timeout=10).logits == 20
        assert _follow(sched, chained)[0] == [6, 7]
    finally:
        sched.close()
    step = events[events.index("prefill sent [[5], [20]]"):]
    # the prompts' pass, then the next step's decode pass sent (with the chain's first decode), and only
    # then the prompts' results, while the model computes that pass
    assert step[:5] == ["prefill sent [[5], [20]]", "prefill done", "decode sent [6]", "published chained",
                        "published plain"], events  # fmt: skip


def test_held_prompt_results_go_out_when_no_step_follows() -> None:
    events: list[str] = []
    compute = DecodesApart(events)
    sched = BatchingScheduler(compute)
    try:
        blocker = _hold_loop(sched, compute)
        prompts = [sched.submit_prefill(Served(), [p], object(), prompt_end=1, owner=_owner(f"p{p}"))
                   for p in (20, 30)]  # fmt: skip
        compute.prefill_gate.set()
        blocker.join(timeout=10)
        # no chain, nothing else waits: the loop hands the results out before it waits for work
        assert [p.result(timeout=5).logits for p in prompts] == [20, 30]
    finally:
        sched.close()


class WantsNoted(DecodesApart):
    """DecodesApart that notes what of each pass's logits the scheduler asks for (`logits`)."""

    def start_prefill_many(self, served, chunks, states, prompt_ends, logits=None):
        self.events.append(f"prefill wants {list(logits)}")
        return super().start_prefill_many(served, chunks, states, prompt_ends, logits)

    def start_decode_many(self, served, tokens, states, logits=None):
        self.events.append(f"decode wants {list(logits)}")
        return super().start_decode_many(served, tokens, states, logits)


def test_a_pass_sent_apart_asks_only_for_the_logits_its_chains_read() -> None:
    """A greedy chain's passes want only the greedy choice, a chain that draws at a temperature the whole
    row, and a pass without a chain (a prompt without one, the persisted last token's decode) none."""
    events: list[str] = []
    compute = WantsNoted(events)
    sched = BatchingScheduler(compute)

    class Next:
        """A sampler that says whether it samples greedily (`greedy`, as engine.sampler.Sampler does)."""

        def __init__(self, greedy: bool) -> None:
            self.greedy = greedy

        def __call__(self, logits: int) -> int:
            return logits + 1

    def chain(greedy: bool) -> DecodeChain:
        return DecodeChain(Next(greedy), stops=(), max_new_tokens=2, persist=True)

    try:
        blocker = _hold_loop(sched, compute)
        greedy = sched.submit_prefill(Served(), [5], object(), prompt_end=1, owner=_owner("g"),
                                      chain=chain(True))  # fmt: skip
        drawn = sched.submit_prefill(Served(), [7], object(), prompt_end=1, owner=_owner("d"),
                                     chain=chain(False))  # fmt: skip
        plain = sched.submit_prefill(Served(), [20], object(), prompt_end=1, owner=_owner("p"))
        compute.gate.set()
        compute.prefill_gate.set()
        blocker.join(timeout=10)
        assert plain.result(timeout=10).logits == 20
        assert _follow(sched, greedy, _owner("g"))[0] == [6, 7]
        assert _follow(sched, drawn, _owner("d"))[0] == [8, 9]
    finally:
        sched.close()
    assert "prefill wants ['argmax', 'full', 'none']" in events, events
    # each chain's first decode samples again (its chain goes on); the decode of its last token only persists
    assert "decode wants ['argmax', 'full']" in events, events
    assert "decode wants ['none', 'none']" in events, events
