"""A turn streams the tokens whose passes have already ended in one TokenChunk (turn_engine.py,
`_decoded_ahead`): the same tokens in the same order, in fewer messages, and never a token held back for
another. Unit cases over futures, and a real node on which one session's passes are made to run in the
batching scheduler's loop (whose decode chains queue each next decode) while its handler is slowed, so
that its chain runs ahead of it. (A first version ran four sessions together and hoped their steps would
overlap: under CI's load none did once, and it failed.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from orchestrator.api import TurnHandle
from orchestrator.engine.turn_engine import _decoded_ahead
from orchestrator.scheduler import Continued
from tests.orchestrator.engine.node_harness import md, registry, start_node


def _done(value: object = None, error: BaseException | None = None) -> Future:
    f: Future = Future()
    if error is not None:
        f.set_exception(error)
    else:
        f.set_result(value)
    return f


def _got(token: int, nxt: Future | None) -> Continued:
    return Continued(output=None, token=token, decode=True, then=None, next=nxt)


def _handle() -> TurnHandle:
    return TurnHandle(session_id="s", request_id="r", tenant_id="t")


def test_a_pass_already_ended_is_taken_with_the_token_before_it() -> None:
    ahead = _got(8, None)
    assert _decoded_ahead(_got(7, _done(ahead)), 7, set(), 1, 4, _handle()) is ahead


@pytest.mark.parametrize(
    "case",
    ["not done", "failed", "cancelled", "halted", "last decode", "no next", "stop", "length", "aborted"],
)
def test_nothing_is_taken_ahead_where_the_turn_must_wait_or_stop(case: str) -> None:
    nxt = _done(_got(8, None))
    stops, generated, handle = set(), 1, _handle()
    if case == "not done":
        nxt = Future()
    elif case == "failed":
        nxt = _done(error=RuntimeError("pass failed"))
    elif case == "cancelled":
        nxt = Future()
        nxt.cancel()
    elif case == "halted":
        nxt = _done(Continued(output=None, token=None, decode=False, then=None, next=None))
    elif case == "last decode":
        nxt = _done(object())  # the turn's last decode: a bare output, nothing sampled after it
    elif case == "no next":
        nxt = None
    elif case == "stop":
        stops = {7}
    elif case == "length":
        generated = 4
    else:
        handle.cancel("client cancelled")
    assert _decoded_ahead(_got(7, nxt), 7, stops, generated, 4, handle) is None


def _turns(node, sid: str, scripts: list[list[int]], max_new: int) -> list[tuple[list[list[int]], int]]:
    """Each turn's token chunks as streamed, and the stats' generated count."""
    pb, out = node.pb, []
    for ids in scripts:
        generation = pb.sessions.GenerationParams(max_new_tokens=max_new)
        request = pb.sessions.TurnRequest(
            session_id=sid, tokens=pb.sessions.TokenIds(ids=ids), generation=generation
        )
        chunks, generated = [], -1
        for event in node.sessions.Turn(request, metadata=md()):
            if event.WhichOneof("event") == "tokens":
                chunks.append(list(event.tokens.ids))
            elif event.WhichOneof("event") == "stats":
                generated = event.stats.generated_tokens
        out.append((chunks, generated))
    return out


_PROMPT_A = [16 + j % 400 for j in range(20)]
_PROMPT_B = [40 + 3 * j % 400 for j in range(25)]


def _serve(tmp_path: Path, models, *, slow_handlers: bool) -> list[tuple[list[list[int]], int]]:
    """Session B's turn (8 tokens) on the batching scheduler, its chunks as streamed.

    With `slow_handlers`, deterministically run ahead of: session A's prompt pass (which runs inline in
    A's thread, the loop being idle) is held until B's prompt waits in the loop's queue, so B's passes run
    in the loop's steps, whose decode chains queue each next decode themselves; and every chunk's text
    takes 0.5 s to decode, so B's chain ends its passes while B's thread streams its first token."""
    node = start_node(tmp_path, models, scheduler="batching", step_token_budget=48)
    try:
        pb = node.pb
        create = pb.sessions.CreateSessionRequest(model="a")
        sid_a, sid_b = (
            node.sessions.CreateSession(create, metadata=md()).session.session_id for _ in range(2)
        )
        if not slow_handlers:
            return _turns(node, sid_b, [_PROMPT_B], 8)
        scheduler = node.service.engine.scheduler
        compute = scheduler.compute
        entered, release = threading.Event(), threading.Event()
        held_prefill = compute.prefill

        def gated_prefill(*args, **kwargs):
            if not entered.is_set():
                entered.set()
                assert release.wait(60)
            return held_prefill(*args, **kwargs)

        compute.prefill = gated_prefill
        codec = node.service.registry.get("a").codec
        fast = codec.decode

        def slow(ids):
            time.sleep(0.5)
            return fast(ids)

        codec.decode = slow
        a = threading.Thread(target=_turns, args=(node, sid_a, [_PROMPT_A], 1))
        a.start()
        assert entered.wait(60), "session A's prompt pass never started"
        got: list = []
        b = threading.Thread(target=lambda: got.extend(_turns(node, sid_b, [_PROMPT_B], 8)))
        b.start()
        deadline = time.monotonic() + 60
        while scheduler.waiting("a") < 1:
            assert time.monotonic() < deadline, "session B's prompt never reached the loop's queue"
            time.sleep(0.01)
        release.set()
        a.join(timeout=120)
        b.join(timeout=120)
        return got
    finally:
        node.stop()


def test_tokens_decoded_ahead_of_a_slow_handler_go_out_together_and_unchanged(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    models = registry()
    plain = _serve(tmp_path / "plain", models, slow_handlers=False)
    slowed = _serve(tmp_path / "slowed", models, slow_handlers=True)
    ((chunks, generated),), ((plain_chunks, _),) = slowed, plain
    tokens = [t for c in chunks for t in c]
    assert tokens == [t for c in plain_chunks for t in c] and len(tokens) == 8
    assert generated == len(tokens) and all(chunks)
    # the first token alone (its chain's next pass had not ended), the rest together
    assert len(chunks) < len(tokens), f"no chunk carried more than one token: {chunks}"
