"""The chat template of the sibling family: OpenAI-style messages to the token ids the models were trained on.

Knows nothing of sessions or HTTP; it needs only the model's text encoder, and a lookup of the ids the model
generated for an assistant text (so that a resent answer renders as the ids already in the history).
See orchestrator/README.md, "The chat template", for the rendered form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ASST",
    "BOS",
    "END",
    "EOS",
    "RESULT",
    "ROLES",
    "TOOL",
    "USER",
    "ChatMessage",
    "ChatTemplate",
    "ToolCall",
    "render_text",
]

# The family's special-token ids (checkpoints/tokenizer/README.md; identical in the byte fallback).
BOS, EOS, USER, ASST, TOOL, RESULT, END = 1, 2, 3, 4, 5, 6, 7
# Their spellings; the BPE tokenizer turns these, written literally in a text, into the ids above.
_SPELLING = {
    BOS: "<bos>",
    EOS: "<eos>",
    USER: "<user>",
    ASST: "<asst>",
    TOOL: "<tool>",
    RESULT: "<result>",
    END: "<end>",
}
# Every special spelling, so that markers typed inside a message stay text. A copy of model.train's
# SPECIAL_TOKENS on purpose: the light CLI renders chats without importing the model stack (torch);
# tests/orchestrator/chat/test_chat_template.py pins the two equal.
_ALL_SPECIAL = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<user>",
    "<asst>",
    "<tool>",
    "<result>",
    "<end>",
    "<key>",
    "<val>",
    "<q>",
    "<a>",
    "<reserved_0>",
    "<reserved_1>",
    "<reserved_2>",
    "<reserved_3>",
)
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in _ALL_SPECIAL))
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """A tool call an assistant message carries (rendered; the trained family never produces one)."""

    name: str
    arguments: str = ""


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    """One message: role in ROLES, its text content, and an assistant's tool calls."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is not one of {', '.join(ROLES)}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls (only assistant messages)")


@dataclass(frozen=True, kw_only=True)
class _Piece:
    """A piece of the rendered prompt: a special id, or text (markers spelt in it stay ordinary text)."""

    special: int | None = None
    text: str = ""
    # An assistant's answer: its ids may come from the generated-ids record.
    answer: bool = False


def _block(marker: int, text: str) -> list[_Piece]:
    # `<user> text <end>`: the spaces inside the markers as in the training transcripts.
    return [_Piece(special=marker), _Piece(text=f" {text} "), _Piece(special=END)]


def _pieces(
    messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]], *, open_assistant: bool
) -> list[_Piece]:
    out = [_Piece(special=BOS)]
    if tools:
        # One canonical JSON line, so that the same tools render the same ids on every request.
        out += _block(
            TOOL, json.dumps(list(tools), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        )
    for m in messages:
        if m.role in ("system", "user"):
            out += _block(USER, m.content)
        elif m.role == "tool":
            out += _block(RESULT, m.content)
        else:
            out.append(_Piece(special=ASST))
            if m.content:
                out.append(_Piece(text=m.content, answer=True))
            for call in m.tool_calls:
                out += [
                    _Piece(special=TOOL),
                    _Piece(text=f" {call.name}({call.arguments})"),
                    _Piece(special=END),
                ]
            if not m.tool_calls:
                out.append(_Piece(special=END))
    if open_assistant:
        out.append(_Piece(special=ASST))
    return out


def render_text(
    messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] = (), *, open_assistant: bool = True
) -> str:
    """The template as text, for a gRPC `Turn(text=...)` or `Models.Tokenize` caller: the BPE tokenizer
    turns its markers into the special ids, so it tokenizes to `ChatTemplate.render`'s ids when no content
    spells a marker (content that does is escaped by `render` and not by this text form)."""
    return "".join(
        _SPELLING[p.special] if p.special is not None else p.text
        for p in _pieces(messages, tools, open_assistant=open_assistant)
    )


@dataclass(kw_only=True)
class ChatTemplate:
    """Renders messages to ids with one model's encoder.

    Args:
        encode: the model's text encoder (`TextCodec.encode`).
        generated_ids: the ids the model generated for an assistant text, or None when it did not produce
            that text (then the text is re-tokenised, which may give other ids than the model produced).
    """

    encode: Callable[[str], list[int]]
    generated_ids: Callable[[str], Sequence[int] | None] = field(default=lambda _text: None)

    def _content(self, text: str) -> list[int]:
        """Ids of message content: a marker spelt in it (`<end>`, `<asst>`, ...) stays ordinary text, so a
        message cannot open or close a turn; its '<' is encoded on its own."""
        ids: list[int] = []
        at = 0
        for m in _SPECIAL_RE.finditer(text):
            if m.start() > at:
                ids += self.encode(text[at : m.start()])
            ids += self.encode("<") + self.encode(m.group()[1:])
            at = m.end()
        if at < len(text):
            ids += self.encode(text[at:])
        return ids

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        open_assistant: bool = True,
    ) -> list[int]:
        """The prompt ids: `<bos>`, the tools block (when given), each message, and `<asst>` to open the
        answer (unless `open_assistant` is False).

        Raises:
            ValueError: no messages.
        """
        if not messages:
            raise ValueError("messages must hold at least one message")
        ids: list[int] = []
        for p in _pieces(messages, tools, open_assistant=open_assistant):
            if p.special is not None:
                ids.append(p.special)
            elif p.answer:
                known = self.generated_ids(p.text)
                ids += list(known) if known is not None else self._content(p.text)
            else:
                ids += self._content(p.text)
        return ids
