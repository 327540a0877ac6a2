"""The OpenAI-compatible routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, as a
FastAPI app over a `FrontDoor`.

Knows nothing of how the app is served (server.py runs it on uvicorn). Blocking work (registry, tokenizer,
the turn) runs on the front door's threads; a client that disconnects cancels its turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from orchestrator.api import (
    FinishReason,
    InvalidRequestError,
    PlanEvent,
    TokenChunkEvent,
    TurnInput,
    TurnStatsEvent,
)
from orchestrator.http.errors import error_response, http_error
from orchestrator.http.front_door import FrontDoor, PreparedTurn
from orchestrator.http.schemas import ChatCompletionRequest, CompletionRequest
from orchestrator.http.turn_bridge import TurnBridge

__all__ = ["build_app"]

log = structlog.get_logger(__name__)

_CHAT = "POST /v1/chat/completions"
_COMPLETIONS = "POST /v1/completions"
_MODELS = "GET /v1/models"
# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.1


class _Answer:
    """The answer as it streams: content ids (stop token excluded) and text deltas that never split a
    character (a byte-level token can end inside one)."""

    def __init__(self, door: FrontDoor, prepared: PreparedTurn) -> None:
        self._door = door
        self._prepared = prepared
        self.ids: list[int] = []
        self.text = ""
        self.plan: PlanEvent | None = None
        self.stats: TurnStatsEvent | None = None

    def add(self, event: TokenChunkEvent) -> str:
        self.ids += [i for i in event.ids if i not in self._prepared.stop_ids]
        full = self._door.decode(self._prepared.model, self.ids)
        # U+FFFD at the end: an unfinished UTF-8 sequence; wait for the next token.
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def finish(self) -> str:
        """The rest of the text (a held-back tail), and the answer recorded when the turn was kept."""
        full = self._door.decode(self._prepared.model, self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        stats = self.stats
        if stats is not None and stats.kept and stats.finish_reason != FinishReason.ABORTED:
            self._door.remember(self._prepared, self.text, self.ids)
        self._door.turn_ended(self._prepared)
        return delta

    def finish_reason(self) -> str | None:
        if self.stats is None:
            return None
        return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(
            self.stats.finish_reason, "stop"
        )

    def usage(self) -> dict[str, Any]:
        counts = self.stats.counts if self.stats is not None else None
        cached = counts.cached + counts.mapped if counts is not None else 0
        prompt = counts.prompt_tokens if counts is not None else self._prepared.prompt_tokens
        completion = self.stats.generated_tokens if self.stats is not None else len(self.ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def extension(self) -> dict[str, Any]:
        """The `kvresume` object: the plan's path and reason (the gRPC enums' names) and counts by kind."""
        assert self.plan is not None
        plan = self.plan.plan
        out: dict[str, Any] = {
            "session_id": self._prepared.turn.session_id,
            "request_id": self._prepared.turn.request_id,
            "turn_index": self.plan.turn_index,
            "new_session": self._prepared.new_session,
            "sent_tokens": len(self._prepared.turn.tokens or ()),
            "path": f"RESUME_PATH_{plan.path}",
            "model": plan.model,
            "reason": plan.reason,
            "reason_code": f"PLAN_REASON_{plan.reason_code}",
            "counts": {
                "cached": plan.counts.cached,
                "mapped": plan.counts.mapped,
                "prefilled": plan.counts.prefilled,
                "replayed_encoder": plan.counts.replayed_encoder,
                "replayed_decoder": plan.counts.replayed_decoder,
            },
            "persist": plan.persist,
        }
        if self.stats is not None:
            out |= {
                "ttft_s": self.stats.ttft_s,
                "total_s": self.stats.total_s,
                "persisted": self.stats.persisted,
                "kept": self.stats.kept,
            }
        return out


def _count(door: FrontDoor, route: str, code: str) -> None:
    door.ctx.metrics.rpcs.labels(method=route, code=code).inc()


async def _first_event(bridge: TurnBridge, events: AsyncIterator[Any]) -> PlanEvent:
    """The plan: errors before it are the request's HTTP error (raised), after it the stream's."""
    first = await anext(events)
    assert isinstance(first, PlanEvent), f"turn began with {type(first).__name__}"
    return first


def _chunk(prepared: PreparedTurn, chat: bool, **fields: Any) -> dict[str, Any]:
    prefix = "chatcmpl" if chat else "cmpl"
    return {
        "id": f"{prefix}-{prepared.turn.request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": prepared.created,
        "model": prepared.model,
        **fields,
    }


def _choice(chat: bool, *, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    body: dict[str, Any] = {"content": text}
    if not delta:
        body["role"] = "assistant"
        return {"index": 0, "message": body, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "delta": body, "finish_reason": finish, "logprobs": None}


def build_app(door: FrontDoor) -> FastAPI:
    """The ASGI app of the front door (no docs pages: the API is OpenAI's)."""
    app = FastAPI(title="kvresume", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid_request(door, f"{request.method} {request.url.path}", exc.errors())

    @app.get("/v1/models")
    async def list_models(authorization: str | None = Header(default=None)) -> JSONResponse:
        try:
            door.tenant(authorization)
        except Exception as exc:  # noqa: BLE001 - every exception is mapped through the status table
            return _failed(door, _MODELS, exc)
        _count(door, _MODELS, "OK")
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvresume"} for m in door.models()]
        return JSONResponse({"object": "list", "data": data})

    async def _complete(
        request: Request,
        route: str,
        body: ChatCompletionRequest | CompletionRequest,
        authorization: str | None,
        session_key: str | None,
        timeout: str | None,
    ) -> Any:
        chat = isinstance(body, ChatCompletionRequest)
        try:
            tenant = door.tenant(authorization)
            timeout_s = _timeout(timeout)
            prepare_fn = door.prepare_chat if chat else door.prepare_completion

            def prepare() -> tuple[PreparedTurn, TurnInput]:
                got = prepare_fn(tenant, body, session_key=session_key, timeout_s=timeout_s)
                return got, got.turn

            bridge = TurnBridge(door.ctx, prepare, door.executor)
            events = bridge.events()
            try:
                prepared = await bridge.prepared()
                plan = await _first_event(bridge, events)
            except asyncio.CancelledError:
                bridge.cancel("client went away")
                raise
        except Exception as exc:  # noqa: BLE001 - every exception is mapped through the status table
            return _failed(door, route, exc)
        answer = _Answer(door, prepared)
        answer.plan = plan
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventSourceResponse(
                _stream(
                    door, route, prepared, bridge, events, answer, chat=chat, include_usage=include_usage
                ),
                ping=15,
            )
        return await _whole(door, route, request, prepared, bridge, events, answer, chat=chat)

    # The bodies are parsed here by pydantic's own JSON parser (not FastAPI's body parameter: about 0.4 ms
    # less per request on the path to the first token, for the same validation and error).
    @app.post("/v1/chat/completions")
    async def chat_completions(
        request: Request,
        authorization: str | None = Header(default=None),
        x_session_id: str | None = Header(default=None),
        x_request_timeout: str | None = Header(default=None),
    ) -> Any:
        try:
            body = ChatCompletionRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _invalid_request(door, _CHAT, exc.errors())
        return await _complete(request, _CHAT, body, authorization, x_session_id, x_request_timeout)

    @app.post("/v1/completions")
    async def completions(
        request: Request,
        authorization: str | None = Header(default=None),
        x_session_id: str | None = Header(default=None),
        x_request_timeout: str | None = Header(default=None),
    ) -> Any:
        try:
            body = CompletionRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _invalid_request(door, _COMPLETIONS, exc.errors())
        return await _complete(request, _COMPLETIONS, body, authorization, x_session_id, x_request_timeout)

    return app


def _invalid_request(door: FrontDoor, route: str, errors: Any) -> JSONResponse:
    """400 naming the first invalid field (its dotted path in the body)."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    err = InvalidRequestError(
        f"{where or 'body'}: {first.get('msg', 'invalid request')}", field=where or None
    )
    _count(door, route, "INVALID_ARGUMENT")
    return error_response(http_error(err))


def _timeout(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InvalidRequestError(
            f"X-Request-Timeout={header[:32]!r} must be a positive number of seconds",
            field="X-Request-Timeout",
        )
    return value


def _failed(door: FrontDoor, route: str, exc: BaseException) -> JSONResponse:
    err = http_error(exc)
    if err.status >= 500:
        log.error("http_request_failed", route=route, status=err.status, reason=err.reason, exc_info=exc)
    else:
        log.info(
            "http_request_rejected", route=route, status=err.status, reason=err.reason, detail=err.message
        )
    _count(door, route, err.code)
    return error_response(err)


async def _whole(
    door: FrontDoor,
    route: str,
    request: Request,
    prepared: PreparedTurn,
    bridge: TurnBridge,
    events: AsyncIterator[Any],
    answer: _Answer,
    *,
    chat: bool,
) -> JSONResponse:
    """Collect the turn; a client that goes away meanwhile cancels it."""
    pending = asyncio.ensure_future(_drain(events, answer))
    try:
        while not pending.done():
            await asyncio.wait({pending}, timeout=_DISCONNECT_POLL_S)
            if not pending.done() and await request.is_disconnected():
                bridge.cancel("client went away")
        pending.result()
    except asyncio.CancelledError:
        bridge.cancel("client went away")
        raise
    except Exception as exc:  # noqa: BLE001 - every exception is mapped through the status table
        return _failed(door, route, exc)
    answer.finish()
    _count(door, route, "OK")
    body = _chunk(
        prepared, chat, choices=[_choice(chat, text=answer.text, finish=answer.finish_reason(), delta=False)]
    )
    body["object"] = "chat.completion" if chat else "text_completion"
    body |= {"usage": answer.usage(), "kvresume": answer.extension()}
    return JSONResponse(body)


async def _drain(events: AsyncIterator[Any], answer: _Answer) -> None:
    async for event in events:
        if isinstance(event, TokenChunkEvent):
            answer.add(event)
        elif isinstance(event, TurnStatsEvent):
            answer.stats = event


async def _stream(
    door: FrontDoor,
    route: str,
    prepared: PreparedTurn,
    bridge: TurnBridge,
    events: AsyncIterator[Any],
    answer: _Answer,
    *,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[dict[str, str]]:
    """SSE events in OpenAI's chunk format, ending with `data: [DONE]`."""

    def data(obj: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(obj, separators=(",", ":"))}

    finished = False
    try:
        if chat:
            opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield data(_chunk(prepared, chat, choices=[opening]))
        async for event in events:
            if isinstance(event, TokenChunkEvent):
                delta = answer.add(event)
                if delta:
                    yield data(
                        _chunk(prepared, chat, choices=[_choice(chat, text=delta, finish=None, delta=True)])
                    )
            elif isinstance(event, TurnStatsEvent):
                answer.stats = event
        finished = True
        tail = answer.finish()
        last = _chunk(
            prepared, chat, choices=[_choice(chat, text=tail, finish=answer.finish_reason(), delta=True)]
        )
        last["kvresume"] = answer.extension()
        yield data(last)
        if include_usage:
            yield data(_chunk(prepared, chat, choices=[], usage=answer.usage(), kvresume=answer.extension()))
        _count(door, route, "OK")
        yield {"data": "[DONE]"}
    except (asyncio.CancelledError, GeneratorExit):
        bridge.cancel("client went away")
        _count(door, route, "CANCELLED")
        raise
    except Exception as exc:  # noqa: BLE001 - after the plan, an error ends the stream as OpenAI's do
        err = http_error(exc)
        _count(door, route, err.code)
        log.error("http_stream_failed", route=route, reason=err.reason, exc_info=exc)
        yield data(
            {"error": {"message": err.message, "type": err.type, "param": err.field, "code": err.reason}}
        )
    finally:
        if not finished:
            bridge.cancel("stream ended early")
