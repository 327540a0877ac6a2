"""Retention and residency policies per tenant, with the rule that the ceiling wins over the floor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from orchestrator.db.models import Policy, utcnow
from orchestrator.db.repositories.read_connection import read_connection

__all__ = ["PolicyRepository", "EffectivePolicy", "effective_policy"]

_POLICIES = Policy.__table__
# Every turn reads its tenant's policy: the statement built once, the row read without an ORM object.
_EFFECTIVE = select(
    _POLICIES.c.retention_floor_s, _POLICIES.c.retention_ceiling_s, _POLICIES.c.allowed_regions
).where(_POLICIES.c.tenant_id == bindparam("tid"))


@dataclass(frozen=True, kw_only=True)
class EffectivePolicy:
    """The policy in force for a tenant: stored values, or the service defaults when none is stored.

    `floor_s` never exceeds `ceiling_s` (ARCHITECTURE §4: when they conflict, the ceiling wins).
    An empty `allowed_regions` means KV may be stored in any region.
    """

    tenant_id: str
    floor_s: float
    ceiling_s: float
    allowed_regions: tuple[str, ...]
    is_default: bool

    def __post_init__(self) -> None:
        if self.ceiling_s <= 0 or self.floor_s < 0:
            raise ValueError(f"retention floor {self.floor_s} / ceiling {self.ceiling_s} out of range")
        if self.floor_s > self.ceiling_s:
            object.__setattr__(self, "floor_s", self.ceiling_s)

    def may_store_in(self, region: str) -> bool:
        return not self.allowed_regions or region in self.allowed_regions

    def clip_retention(self, hint_s: float | None) -> float:
        """A session's retention: the hint clipped into [floor, ceiling], or the ceiling without a hint."""
        if hint_s is None:
            return self.ceiling_s
        return min(max(hint_s, self.floor_s), self.ceiling_s)


def effective_policy(
    tenant_id: str, row: Any, *, default_floor_s: float, default_ceiling_s: float
) -> EffectivePolicy:
    """The policy in force from the `_EFFECTIVE` row of the tenant's policy (None: the defaults)."""
    if row is None:
        return EffectivePolicy(
            tenant_id=tenant_id,
            floor_s=default_floor_s,
            ceiling_s=default_ceiling_s,
            allowed_regions=(),
            is_default=True,
        )
    return EffectivePolicy(
        tenant_id=tenant_id,
        floor_s=row.retention_floor_s,
        ceiling_s=row.retention_ceiling_s,
        allowed_regions=tuple(row.allowed_regions),
        is_default=False,
    )


class PolicyRepository:
    def __init__(self, session: Session) -> None:
        self._s = session

    def get(self, tenant_id: str) -> Policy | None:
        return self._s.get(Policy, tenant_id)

    def effective(
        self, tenant_id: str, *, default_floor_s: float, default_ceiling_s: float
    ) -> EffectivePolicy:
        row = read_connection(self._s).execute(_EFFECTIVE, {"tid": tenant_id}).one_or_none()
        return effective_policy(
            tenant_id, row, default_floor_s=default_floor_s, default_ceiling_s=default_ceiling_s
        )

    def set(
        self,
        tenant_id: str,
        *,
        floor_s: float,
        ceiling_s: float,
        allowed_regions: Sequence[str],
    ) -> Policy:
        """Store the tenant's policy (the tenant row must exist).

        Raises:
            ValueError: a floor that is not finite and >= 0, a ceiling that is not finite and > 0 (the
                store refuses both, and a row it refuses would stop every later start-up sync), or an
                empty region label.
        """
        if not (math.isfinite(floor_s) and floor_s >= 0):
            raise ValueError(f"retention floor_s={floor_s} must be finite and >= 0")
        if not (math.isfinite(ceiling_s) and ceiling_s > 0):
            raise ValueError(f"retention ceiling_s={ceiling_s} must be finite and > 0")
        if any(not r for r in allowed_regions):
            raise ValueError(f"allowed_regions={list(allowed_regions)} contains an empty label")
        row = self.get(tenant_id)
        regions = sorted(set(allowed_regions))
        if row is None:
            row = Policy(
                tenant_id=tenant_id,
                retention_floor_s=floor_s,
                retention_ceiling_s=ceiling_s,
                allowed_regions=regions,
            )
            self._s.add(row)
        else:
            row.retention_floor_s = floor_s
            row.retention_ceiling_s = ceiling_s
            row.allowed_regions = regions
            row.updated_at = utcnow()
        self._s.flush()
        return row
