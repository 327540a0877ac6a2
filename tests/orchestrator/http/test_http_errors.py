"""Errors over HTTP as OpenAI error JSON, each provoked with a real bad request against a real node (400, 401,
403, 404, 409, 429, 503, 504) and read with the official client and raw httpx; the status table's HTTP column
covers every gRPC code the table can give.
"""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import openai
import pytest
from sqlalchemy.exc import OperationalError

from orchestrator.api import errors
from orchestrator.api.status_table import HTTP_BY_CODE, STATUS_TABLE, http_error_for
from orchestrator.model_process import ModelProcessError
from tests.orchestrator.http.conftest import ADMIN, MODEL, TOKENS, HttpNode, start_http_node

MESSAGES = [{"role": "user", "content": "Fix resume()."}]


def _post(
    node: HttpNode, body: dict, *, token: str | None = TOKENS["acme"], **headers: str
) -> httpx.Response:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{node.base_url}/chat/completions", json=body, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param, err
    assert err["type"] == (
        HTTP_BY_CODE[grpc.StatusCode.INVALID_ARGUMENT][1] if status == 400 else err["type"]
    )
    return err


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


def test_400_names_the_bad_field(http_node: HttpNode) -> None:
    err = _error(_post(http_node, _body(temperature=5)), 400, "INVALID_ARGUMENT", "temperature")
    assert "temperature" in err["message"]
    _error(_post(http_node, _body(messages=[])), 400, "INVALID_ARGUMENT", "messages")
    _error(_post(http_node, _body(n=2)), 400, "INVALID_ARGUMENT", "n")
    _error(_post(http_node, _body(stop=["two words"])), 400, "INVALID_ARGUMENT", "stop")
    _error(_post(http_node, _body(max_tokens=65)), 400, "INVALID_ARGUMENT", "max_tokens")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    _error(_post(http_node, _body(messages=image)), 400, "INVALID_ARGUMENT", "messages[0].content")
    with pytest.raises(openai.BadRequestError) as info:
        http_node.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert info.value.code == "INVALID_ARGUMENT"
    # unknown fields are tolerated, as OpenAI does for parameters a backend does not support
    assert (
        _post(http_node, _body(frequency_penalty=0.5, logit_bias={}, user="u1", no_such_field=1)).status_code
        == 200
    )


def test_a_body_over_max_request_bytes_is_refused(http_node: HttpNode) -> None:
    limit = http_node.service.ctx.settings.max_request_bytes
    huge = _body(messages=[{"role": "user", "content": "x" * (limit + 10)}])
    err = _error(_post(http_node, huge), 400, "REQUEST_TOO_LARGE", "body")
    assert str(limit) in err["message"]

    def chunks():
        # no Content-Length: counted as it arrives
        yield json.dumps(huge).encode()

    headers = {"Authorization": f"Bearer {TOKENS['acme']}", "Content-Type": "application/json"}
    r = httpx.post(f"{http_node.base_url}/chat/completions", content=chunks(), headers=headers, timeout=60)
    _error(r, 400, "REQUEST_TOO_LARGE", "body")


def test_401_and_403(http_node: HttpNode) -> None:
    _error(_post(http_node, _body(), token=None), 401, "UNAUTHENTICATED")
    _error(_post(http_node, _body(), token="wrong"), 401, "UNAUTHENTICATED")
    with pytest.raises(openai.AuthenticationError):
        http_node.client().with_options(api_key="wrong").models.list()
    _error(_post(http_node, _body(), token=ADMIN), 403, "PERMISSION_DENIED")


def test_404_unknown_model(http_node: HttpNode) -> None:
    err = _error(_post(http_node, _body(model="gpt-4o")), 404, "MODEL_NOT_SERVED")
    assert MODEL in err["message"]
    with pytest.raises(openai.NotFoundError):
        http_node.client().chat.completions.create(model="gpt-4o", messages=MESSAGES)
    # counted beside the RPCs, by the gRPC code's name
    rpcs = http_node.service.ctx.metrics.rpcs
    assert rpcs.labels(method="POST /v1/chat/completions", code="NOT_FOUND")._value.get() == 2


def test_409_a_second_request_while_the_session_runs_a_turn(http_node: HttpNode) -> None:
    body = _body(prompt_cache_key="busy", max_tokens=64, stream=True, temperature=0)
    headers = {"Authorization": f"Bearer {TOKENS['acme']}"}
    with httpx.stream(
        "POST", f"{http_node.base_url}/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # the first turn runs (64 tokens take about a second here): the same key is refused meanwhile
        err = _error(_post(http_node, _body(prompt_cache_key="busy")), 409, "TURN_RUNNING")
        assert "running turn" in err["message"]
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    answer = "".join(
        c["delta"].get("content") or "" for line in rest[:-1] for c in json.loads(line[5:])["choices"]
    )
    # once it finished, the key continues the session with the streamed answer and a new message
    more = [*MESSAGES, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    after = _post(http_node, _body(messages=more, prompt_cache_key="busy"))
    assert after.status_code == 200 and not after.json()["kvresume"]["new_session"]


def test_504_past_the_request_timeout(http_node: HttpNode) -> None:
    _error(_post(http_node, _body(), **{"X-Request-Timeout": "0.000001"}), 504, "DEADLINE_EXCEEDED")
    _error(
        _post(http_node, _body(), **{"X-Request-Timeout": "soon"}),
        400,
        "INVALID_ARGUMENT",
        "X-Request-Timeout",
    )


def test_429_with_retry_after_and_503(tmp_path) -> None:
    node = start_http_node(tmp_path, max_sessions_per_tenant=1)
    try:
        first = _post(node, _body(prompt_cache_key="k", temperature=0))
        assert first.status_code == 200
        # each keyless request is a session of its own: the second session is past the tenant's limit
        limited = _post(node, _body())
        _error(limited, 429, "SESSION_LIMIT")
        assert int(limited.headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            node.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        # the store goes away under the server: the key's session continues, and its turn is UNAVAILABLE
        node.service.store.close()
        answer = first.json()["choices"][0]["message"]["content"]
        more = [*MESSAGES, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
        down = _post(node, _body(messages=more, prompt_cache_key="k"))
        _error(down, 503, "UNAVAILABLE")
        assert int(down.headers["Retry-After"]) >= 1
    finally:
        node.stop()


@pytest.mark.parametrize("cls, code, _reason", STATUS_TABLE, ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_status_of_the_table_has_an_http_status(cls, code, _reason) -> None:
    assert code in HTTP_BY_CODE
    if cls is errors.ResourceExhaustedError:
        exc = cls("x", reason="REQUEST_TOO_LARGE")
    elif cls is OperationalError:
        exc = cls("select 1", None, Exception("connection refused"))
    else:
        exc = cls("x")
    err = http_error_for(exc)
    assert 400 <= err.status < 600
    expected = {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.PERMISSION_DENIED: 403,
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.FAILED_PRECONDITION: 409,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 400,  # REQUEST_TOO_LARGE: a retry cannot help
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    }.get(code)
    if expected is not None:
        assert err.status == expected


def test_an_unexpected_error_is_a_500_without_internals() -> None:
    err = http_error_for(KeyError("secret internals"))
    assert (err.status, err.message, err.reason) == (500, "internal error", "INTERNAL")


def test_capacity_is_429_and_a_concurrent_turn_409() -> None:
    assert http_error_for(errors.ResourceExhaustedError("full")).status == 429
    turn = errors.PreconditionError("busy", reason="TURN_RUNNING", retry_after_s=1.0)
    assert (http_error_for(turn).status, http_error_for(turn).retry_after_s) == (409, 1.0)


def test_a_lost_model_process_is_a_503_with_retry_after() -> None:
    """A turn that met a lost model process failed before its commit: the caller may send it again."""
    err = http_error_for(ModelProcessError("the model process ended during decode_many (exit code -9)"))
    assert (err.status, err.reason, err.retry_after_s) == (503, "UNAVAILABLE", 1.0)
    assert "exit code -9" in err.message


def test_concurrent_requests_of_one_key_get_one_turn(http_node: HttpNode) -> None:
    """Many requests for one key at once: each one runs on the session or gets 409, none fails otherwise."""
    seen: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        status = _post(http_node, _body(prompt_cache_key="race", max_tokens=8)).status_code
        with lock:
            seen.append(status)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(seen) <= {200, 409} and 200 in seen, seen
