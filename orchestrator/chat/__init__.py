"""The chat template of the sibling family (roles to markers, `<end>` closing each turn, `<asst>` opening
the answer) and the record of generated answers that lets a resent conversation render the model's own ids.

Used by the HTTP front door (orchestrator/http/) and documented for gRPC callers (`render_text`).
"""

from orchestrator.chat.answer_record import AnswerRecord
from orchestrator.chat.template import (
    ASST,
    BOS,
    END,
    EOS,
    RESULT,
    ROLES,
    TOOL,
    USER,
    ChatMessage,
    ChatTemplate,
    ToolCall,
    render_text,
)

__all__ = [
    "ASST",
    "BOS",
    "END",
    "EOS",
    "RESULT",
    "ROLES",
    "TOOL",
    "USER",
    "AnswerRecord",
    "ChatMessage",
    "ChatTemplate",
    "ToolCall",
    "render_text",
]
