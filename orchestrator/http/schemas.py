"""Request bodies of the OpenAI-compatible HTTP API, as pydantic models (validated at the edge).

Unknown fields are accepted and ignored, as OpenAI's API does for parameters a backend does not support;
`IGNORED_PARAMETERS` names the known ones (orchestrator/README.md, "The HTTP API"). Knows nothing of the
engine: `orchestrator/http/front_door.py` turns these into turns.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "IGNORED_PARAMETERS",
    "ChatCompletionRequest",
    "ChatMessageIn",
    "CompletionRequest",
    "StreamOptions",
]

# OpenAI parameters accepted and not acted on (also any other unknown field).
IGNORED_PARAMETERS = (
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "user",
    "metadata",
    "store",
    "service_tier",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "suffix",
    "best_of",
)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class _FunctionCall(_Open):
    name: str = Field(max_length=256)
    arguments: str = ""


class _ToolCallIn(_Open):
    id: str | None = None
    type: str = "function"
    function: _FunctionCall


class _ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessageIn(_Open):
    # "developer" is OpenAI's newer name for the system role; "function" is not supported.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one text: text parts joined (other part types are refused by the front door)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def non_text_parts(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.type for p in self.content if p.type != "text"]


class _Sampling(_Open):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # not OpenAI's; vLLM and others accept it
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # Maps the request onto a registry session of the tenant (the X-Session-Id header does the same).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=128)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None

    @property
    def max_new_tokens(self) -> int:
        """0: the node's default."""
        return self.max_completion_tokens or self.max_tokens or 0


class CompletionRequest(_Sampling):
    # a text, a one-text list, or token ids
    prompt: str | list[str] | list[int]
    echo: bool = False

    @property
    def max_new_tokens(self) -> int:
        # OpenAI's default for /v1/completions
        return self.max_tokens or 16
