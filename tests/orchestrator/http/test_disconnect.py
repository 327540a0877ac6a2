"""A client that disconnects cancels its turn through the scheduler's cancellation: the running-turn slot
is released, the turn counts as aborted, nothing of it is kept (the session stays at its last turn), and
its answer is not recorded."""

from __future__ import annotations

import time

import httpx

from tests.orchestrator.http.conftest import MODEL, TOKENS, HttpNode

HEADERS = {"Authorization": f"Bearer {TOKENS['acme']}"}


def _aborted(node: HttpNode) -> float:
    return node.service.ctx.metrics.turns.labels(
        model=MODEL, path="COLD_PREFILL", outcome="aborted"
    )._value.get()


def _wait_idle(node: HttpNode, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(node.service.ctx.running) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(node.service.ctx.running) == 0, "the turn still runs after its client left"


def _body(key: str, *, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write resume() in full."}],
        "max_tokens": 64,
        "temperature": 0,
        "stream": stream,
        "prompt_cache_key": key,
    }


def test_a_streaming_client_that_disconnects_cancels_its_turn(http_node: HttpNode) -> None:
    before = _aborted(http_node)
    url = f"{http_node.base_url}/chat/completions"
    with httpx.stream("POST", url, json=_body("gone-1", stream=True), headers=HEADERS, timeout=60) as r:
        lines = r.iter_lines()
        data = [line for line in (next(lines), next(lines), next(lines)) if line.startswith("data:")]
        assert data
    # the response is closed after a few chunks of 64: the turn stops at its next step
    sid = http_node.http.door.keys.get("acme", "gone-1")
    assert sid is not None
    _wait_idle(http_node)
    deadline = time.monotonic() + 10
    while _aborted(http_node) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _aborted(http_node) == before + 1
    assert http_node.history(sid) == []
    assert len(http_node.http.door.answers) == 0 or all(
        a.session_id != sid
        for answers in http_node.http.door.answers._by_tenant.values()
        for a in answers.values()
    )


def test_a_waiting_client_that_disconnects_cancels_its_turn(http_node: HttpNode) -> None:
    before = _aborted(http_node)
    url = f"{http_node.base_url}/chat/completions"
    try:
        # the client gives up long before 64 tokens are generated, and closes the connection
        httpx.post(url, json=_body("gone-2", stream=False), headers=HEADERS, timeout=0.3)
        raise AssertionError("the request finished before the client's timeout")
    except httpx.TimeoutException:
        pass
    sid = http_node.http.door.keys.get("acme", "gone-2")
    assert sid is not None
    _wait_idle(http_node)
    deadline = time.monotonic() + 10
    while _aborted(http_node) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _aborted(http_node) == before + 1
    assert http_node.history(sid) == []
