"""A turn streams the tokens whose passes have already ended in one TokenChunk (turn_engine.py,
`_decoded_ahead`): the same tokens in the same order, in fewer messages, and never a token held back for
another. Unit cases over futures, and a real node whose turns' handlers are slowed so that the batching
scheduler's decode chains run ahead of them."""

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


def _serve(tmp_path: Path, models, *, slow_handlers: bool) -> dict[int, list[tuple[list[list[int]], int]]]:
    """Four sessions of two turns each, run together on the batching scheduler; with `slow_handlers`,
    each turn's handler pauses 0.1 s whenever it streams a chunk, while its chain goes on."""
    node = start_node(tmp_path, models, scheduler="batching", step_token_budget=48)
    results: dict[int, list] = {}
    try:
        if slow_handlers:
            codec = node.service.registry.get("a").codec
            fast = codec.decode

            def slow(ids):
                time.sleep(0.1)
                return fast(ids)

            codec.decode = slow
        pb = node.pb
        create = pb.sessions.CreateSessionRequest(model="a")
        sids = [node.sessions.CreateSession(create, metadata=md()).session.session_id for _ in range(4)]

        def run(i: int) -> None:
            scripts = [[16 + (7 * i + j) % 400 for j in range(20 + 5 * i)], [30 + i, 31, 32]]
            results[i] = _turns(node, sids[i], scripts, 8)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        return results
    finally:
        node.stop()


def test_tokens_decoded_ahead_of_a_slow_handler_go_out_together_and_unchanged(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    models = registry()
    plain = _serve(tmp_path / "plain", models, slow_handlers=False)
    slowed = _serve(tmp_path / "slowed", models, slow_handlers=True)
    merged = 0
    for i in range(4):
        for (chunks, generated), (plain_chunks, _) in zip(slowed[i], plain[i], strict=True):
            tokens = [t for c in chunks for t in c]
            assert tokens == [t for c in plain_chunks for t in c], f"session {i}"
            assert generated == len(tokens) and all(chunks)
            merged += sum(len(c) > 1 for c in chunks)
    assert merged, "no chunk carried more than one token: the chains never ran ahead of the handlers"
