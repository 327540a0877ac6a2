"""A real node whose store's disk fills up: turns keep being answered (the KV is not persisted),
`kvresume.store` goes NOT_SERVING with reason write_failing while "" stays SERVING, and when space
returns the store's health and persistence recover without a restart. The registry (SQLite) lives on
another disk (the slow variant puts it on the full disk too: turns may then fail UNAVAILABLE). The
filesystem is a small tmpfs, or an ext4 loop file where tmpfs cannot be mounted."""

from __future__ import annotations

import random
import time
from pathlib import Path

import grpc
import pytest
import torch

from tests.chaos.node_health import STORE, degraded_gauge, health_status
from tests.chaos.small_disk import fill, small_disk
from tests.orchestrator.engine.node_harness import md, registry, run_turn, start_node


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def _turn(node, sid: str, ids: list[int]) -> str:
    """The turn's outcome: its path when answered, else the status code name."""
    try:
        return run_turn(node, sid, ids).path
    except grpc.RpcError as exc:
        return exc.code().name


@pytest.mark.parametrize(
    "registry_on",
    ["other_disk", pytest.param("same_disk", marks=pytest.mark.slow)],
)
def test_disk_full_degrades_store_health_and_recovers(tmp_path: Path, chaos_report, registry_on) -> None:
    torch.set_num_threads(1)
    with small_disk(tmp_path, 48) as (mnt, how):
        if mnt is None:
            pytest.skip(f"no small filesystem for a disk-full run: {how}")
        t0 = time.monotonic()
        sqlite = (tmp_path if registry_on == "other_disk" else mnt) / "registry.sqlite3"
        node = start_node(mnt / "data", registry(), database_url=f"sqlite:///{sqlite}")
        try:
            store = node.service.store
            watch = node.server.store_watch
            assert watch is not None
            sid = node.sessions.CreateSession(
                node.pb.sessions.CreateSessionRequest(model="a"), metadata=md()
            ).session.session_id
            assert _turn(node, sid, _ids(1, 70)) == "COLD_PREFILL"
            chunks_before = store.stats().chunks
            assert chunks_before > 0

            sessions = [
                node.sessions.CreateSession(
                    node.pb.sessions.CreateSessionRequest(model="a"), metadata=md()
                ).session.session_id
                for _ in range(2)
            ]
            filled = fill(mnt / "filler")
            # Each refused write also fails its refusal record: two turns make the 3 failures in a row.
            outcomes = [_turn(node, s, _ids(10 + i, 70)) for i, s in enumerate(sessions)]
            if registry_on == "same_disk":
                # A turn failing in SQL may stop before its store write: three probes make sure the store
                # itself tried three writes on the full disk.
                store.probe_write()
                store.probe_write()
                store.probe_write()
            watch.poll()
            health_full = store.health()
            status_full = (health_status(node.channel, ""), health_status(node.channel, STORE))
            gauge_full = degraded_gauge(node.service.ctx.metrics.exposition())
            refusals = store.stats().refusals.get("io_error", 0)

            (mnt / "filler").unlink()
            t_free = time.monotonic()
            watch.poll()
            status_freed = health_status(node.channel, STORE)
            recovered_s = time.monotonic() - t_free
            after = _turn(node, sessions[0], _ids(20, 8))
            chunks_after = store.stats().chunks
            chaos_report.record(
                f"disk_full_registry_{registry_on}",
                filesystem=how,
                filler_bytes=filled,
                turns_while_full=outcomes,
                store_io_refusals=refusals,
                health_while_full={"": status_full[0], STORE: status_full[1]},
                reasons_while_full=[r.value for r in health_full.reasons],
                gauge_while_full=gauge_full,
                store_health_after_space_returned=status_freed,
                seconds_to_recover_after_space_returned=round(recovered_s, 3),
                turn_after=after,
                chunks_before=chunks_before,
                chunks_after=chunks_after,
                wall_s=round(time.monotonic() - t0, 2),
            )
            assert status_full == ("SERVING", "NOT_SERVING"), (status_full, health_full)
            assert "write_failing" in [r.value for r in health_full.reasons]
            assert gauge_full["write_failing"] == 1.0
            # With the registry on the full disk too, a turn cannot commit its rows: UNAVAILABLE.
            allowed = ("COLD_PREFILL",) if registry_on == "other_disk" else ("COLD_PREFILL", "UNAVAILABLE")
            assert all(o in allowed for o in outcomes), outcomes
            assert status_freed == "SERVING"
            assert after in ("COLD_PREFILL", "GLOBAL_REPLAY", "FULL_HIT") and chunks_after > chunks_before
        finally:
            node.stop()
