"""The HTTP front door's state and its request-to-turn step: caller, served models, the chat template,
session mapping, generation parameters; and the record of answers a committed turn leaves.

Knows nothing of ASGI: routes.py calls it (its blocking parts on `executor`, off the event loop). Shares the
context (auth, registry, engine, running turns, metrics) with the gRPC servicers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from orchestrator.api import (
    InvalidRequestError,
    PermissionDeniedError,
    ResourceExhaustedError,
    ServiceContext,
    TurnInput,
    check_name_length,
    model_not_served,
)
from orchestrator.api.turn_runner import generation_spec
from orchestrator.chat import END, EOS, AnswerRecord, ChatMessage, ChatTemplate, ToolCall
from orchestrator.http.schemas import ChatCompletionRequest, CompletionRequest
from orchestrator.http.session_map import ForgettingPurger, SessionKeys, continued_session
from orchestrator.http.spare_sessions import SpareSessions
from orchestrator.http.token_cache import TokenCache

__all__ = ["FrontDoor", "PreparedTurn"]

# OpenAI's default sampling temperature (the gRPC API's default is greedy, 0).
_DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True, kw_only=True)
class PreparedTurn:
    """A request made into a turn of a registry session."""

    turn: TurnInput
    model: str
    # The whole rendered prompt (what OpenAI's usage.prompt_tokens counts).
    prompt_tokens: int
    # True when the request started a session of its own (no key, an unknown key, or an edited history).
    new_session: bool
    # Generated ids that end the answer and are not part of its text.
    stop_ids: frozenset[int]
    created: int


class FrontDoor:
    """Everything the HTTP routes share; `close` stops its worker threads.

    Args:
        ctx: the service context of the gRPC server in this process.
        workers: threads that run turns and registry work (each running turn holds one while it waits on
            the scheduler, as a gRPC stream holds a worker); default `settings.grpc_workers`.
    """

    def __init__(self, ctx: ServiceContext, *, workers: int | None = None) -> None:
        self.ctx = ctx
        self.answers = AnswerRecord()
        self.keys = SessionKeys()
        self.executor = ThreadPoolExecutor(
            max_workers=workers or ctx.settings.grpc_workers, thread_name_prefix="kvresume-http"
        )
        self.spares = SpareSessions(ctx, self.executor)
        self.tokens = TokenCache()
        # Purges through either API clear this front door's tenant data too.
        if not isinstance(ctx.purger, ForgettingPurger):
            ctx.purger = ForgettingPurger(  # type: ignore[assignment]
                ctx.purger, answers=self.answers, keys=self.keys, spares=self.spares, tokens=self.tokens
            )

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of `Authorization: Bearer <token>` (the gRPC API's tokens).

        Raises:
            UnauthenticatedError: no or an unknown token. PermissionDeniedError: the admin token.
        """
        caller = self.ctx.auth.identify((("authorization", authorization),) if authorization else ())
        if caller.tenant_id is None:
            raise PermissionDeniedError("this call needs a tenant token")
        return caller.tenant_id

    def models(self) -> list[str]:
        return list(self.ctx.served_models or ())

    def _check_model(self, model: str) -> None:
        check_name_length("model", model)
        served = self.ctx.served_models
        if served is not None and model not in served:
            raise model_not_served(model, served)

    def _encode(self, model: str, text: str) -> list[int]:
        catalog = self.ctx.model_catalog
        if catalog is None:
            raise NotImplementedError("this server has no model catalogue")
        return catalog.tokenize(model, text)

    def decode(self, model: str, ids: Sequence[int]) -> str:
        catalog = self.ctx.model_catalog
        assert catalog is not None, "decode before any turn was prepared"
        return catalog.detokenize(model, ids)

    def _stop_ids(self, model: str, stops: list[str], default: tuple[int, ...]) -> frozenset[int]:
        out = set(default)
        for i, text in enumerate(stops):
            ids = self._encode(model, text) if text else []
            if len(ids) != 1:
                raise InvalidRequestError(
                    f"stop[{i}]={text[:64]!r} is {len(ids)} tokens; only single-token stops are supported "
                    "(such as '<end>')",
                    field="stop",
                )
            out.add(ids[0])
        return frozenset(out)

    def _messages(self, body: ChatCompletionRequest) -> list[ChatMessage]:
        out = []
        for i, m in enumerate(body.messages):
            parts = m.non_text_parts()
            if parts:
                raise InvalidRequestError(
                    f"messages[{i}].content holds {', '.join(parts)} parts; only text is supported",
                    field=f"messages[{i}].content",
                )
            calls = tuple(
                ToolCall(name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or ()
            )
            role = "system" if m.role == "developer" else m.role
            try:
                out.append(ChatMessage(role=role, content=m.text(), tool_calls=calls))
            except ValueError as exc:
                raise InvalidRequestError(str(exc), field=f"messages[{i}]") from exc
        return out

    def prepare_chat(
        self, tenant: str, body: ChatCompletionRequest, *, session_key: str | None, timeout_s: float | None
    ) -> PreparedTurn:
        """Render the conversation and map it onto a session (blocking: registry and tokenizer).

        Raises:
            InvalidRequestError, NotFoundError, ResourceExhaustedError, PreconditionError (TURN_RUNNING).
        """
        self._check_model(body.model)
        template = ChatTemplate(
            encode=self.tokens.encoder(tenant, body.model, lambda text: self._encode(body.model, text)),
            generated_ids=lambda text: self.answers.lookup(tenant=tenant, text=text),
        )
        ids = template.render(self._messages(body), body.tools or ())
        stops = self._stop_ids(body.model, body.stops(), (END,))
        return self._prepare(tenant, body, ids, stops, session_key=session_key, timeout_s=timeout_s)

    def prepare_completion(
        self, tenant: str, body: CompletionRequest, *, session_key: str | None, timeout_s: float | None
    ) -> PreparedTurn:
        """The prompt as a turn: a text is tokenized as a gRPC text turn is (markers written in it are
        markers), token ids are sent as they are."""
        self._check_model(body.model)
        if body.echo:
            raise InvalidRequestError("echo is not supported", field="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise InvalidRequestError(f"prompt holds {len(prompt)} texts; send one", field="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            limit = self.ctx.settings.max_turn_tokens * 4
            if len(prompt.encode()) > limit:
                raise ResourceExhaustedError(
                    f"prompt of {len(prompt.encode())} bytes exceeds the limit {limit}",
                    reason="REQUEST_TOO_LARGE",
                    field="prompt",
                )
            ids = self._encode(body.model, prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty", field="prompt")
        stops = self._stop_ids(body.model, body.stops(), (EOS,))
        return self._prepare(tenant, body, ids, stops, session_key=session_key, timeout_s=timeout_s)

    def _prepare(
        self,
        tenant: str,
        body: ChatCompletionRequest | CompletionRequest,
        ids: list[int],
        stops: frozenset[int],
        *,
        session_key: str | None,
        timeout_s: float | None,
    ) -> PreparedTurn:
        if body.n not in (None, 1):
            raise InvalidRequestError(f"n={body.n} is not supported: one choice per request", field="n")
        spec = generation_spec(
            self.ctx,
            max_new_tokens=body.max_new_tokens,
            temperature=_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop_token_ids=tuple(sorted(stops)),
            field="max_tokens",
        )
        key = body.prompt_cache_key or session_key
        if key is not None:
            check_name_length("prompt_cache_key", key)
        target = continued_session(self.ctx, self.keys, tenant=tenant, key=key, tokens=ids) if key else None
        if target is not None:
            session_id, new_tokens = target.session_id, target.new_tokens
        else:
            session_id = self.spares.take(tenant, body.model)
            new_tokens = tuple(ids)
            if key is not None:
                self.keys.set(tenant, key, session_id)
        limit = self.ctx.settings.max_turn_tokens
        if len(new_tokens) > limit:
            raise ResourceExhaustedError(
                f"the request's {len(new_tokens)} new tokens exceed the limit {limit}",
                reason="REQUEST_TOO_LARGE",
                field="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        turn = TurnInput(
            session_id=session_id,
            tenant_id=tenant,
            request_id=uuid.uuid4().hex,
            tokens=new_tokens,
            text=None,
            generation=spec,
            model=body.model,
            deadline_monotonic=None if timeout_s is None else time.monotonic() + timeout_s,
        )
        return PreparedTurn(
            turn=turn,
            model=body.model,
            prompt_tokens=len(ids),
            new_session=target is None,
            stop_ids=stops,
            created=int(time.time()),
        )

    def turn_ended(self, prepared: PreparedTurn) -> None:
        """After the turn of a request that started a session: make the next request's spare session."""
        if prepared.new_session:
            self.spares.refill(prepared.turn.tenant_id, prepared.model)

    def remember(self, prepared: PreparedTurn, text: str, ids: Sequence[int]) -> None:
        """After a committed turn: its answer `text` was generated as `ids` (stop token excluded)."""
        self.answers.remember(
            tenant=prepared.turn.tenant_id, session_id=prepared.turn.session_id, text=text, ids=ids
        )
