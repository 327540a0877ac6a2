"""Fair order of waiting requests: round-robin across tenants, then across a tenant's sessions.

Knows nothing of models; it ranks requests by when their tenant and their session were last served.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.scheduler.work import PassRequest

__all__ = ["FairOrder"]


class FairOrder:
    """Remembers the step at which each tenant and each session last had a request run.

    `rank` puts first the tenant served longest ago (never served first), then within a tenant the
    session served longest ago, then the older request: a tenant with 60 sessions does not starve one
    with 2, and no session waits for more than one round of its tenant's sessions.
    """

    def __init__(self) -> None:
        self._tenant_step: dict[str, int] = {}
        self._session_step: dict[tuple[str, str], int] = {}

    def rank(self, requests: Sequence[PassRequest]) -> list[PassRequest]:
        def key(r: PassRequest) -> tuple[int, int, int]:
            o = r.owner
            return (
                self._tenant_step.get(o.tenant_id, -1),
                self._session_step.get((o.tenant_id, o.session_id), -1),
                r.seq,
            )

        return sorted(requests, key=key)

    def served(self, requests: Sequence[PassRequest], step: int) -> None:
        for r in requests:
            self._tenant_step[r.owner.tenant_id] = step
            self._session_step[(r.owner.tenant_id, r.owner.session_id)] = step

    def forget(self, tenant_id: str, session_id: str) -> None:
        """Drop a session's entry when its turn ends (bounded memory over many sessions); the tenant's
        entry stays, so a tenant does not jump the queue by ending and starting turns."""
        self._session_step.pop((tenant_id, session_id), None)

    def __len__(self) -> int:
        return len(self._session_step)
