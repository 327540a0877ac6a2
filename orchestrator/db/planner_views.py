"""Registry rows as the planner's input views (the planner itself never sees SQL)."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.db.models import MapperRow, SessionRow
from orchestrator.planner import MapperInfo, SessionView

__all__ = ["session_view", "mapper_infos"]


def session_view(row: SessionRow, *, new_tokens: int) -> SessionView:
    """The session before a turn that appends `new_tokens` tokens."""
    return SessionView(
        session_id=row.id,
        tenant_id=row.tenant_id,
        history_len=row.history_tokens,
        new_tokens=new_tokens,
        last_model=row.model if row.turn_count else None,
    )


def mapper_infos(rows: Sequence[MapperRow]) -> tuple[MapperInfo, ...]:
    """Registered mappers; a mapper's score is the figure of its own gate metric (0 when it has none)."""
    return tuple(
        MapperInfo(
            mapper_id=r.id,
            sender_model=r.sender_model,
            receiver_model=r.receiver_model,
            passed_gate=r.passed_gate,
            score=float(r.metrics.get(r.gate_metric, 0.0)) if r.gate_metric else 0.0,
            retention=float(r.metrics["retention"]) if "retention" in r.metrics else None,
        )
        for r in rows
    )
