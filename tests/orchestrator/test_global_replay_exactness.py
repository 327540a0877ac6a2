"""KNOWN BUG (found 2026-12-01, open): a GLOBAL_REPLAY turn does not always equal the uninterrupted
computation. A session of 40 + 3 + 5 + 3 = 51 history tokens (chunks of 32, so a tail chunk [32, 51) at an
odd position of the ratio-2 sources) whose pool entry is gone (dropped, or a restart) generates other
tokens than a cold `ced` prefill of the same prompt followed by decode steps; the first token already
differs. The same bug is older than this session's changes (reproduced at commit 1627e42). The paths test
(`test_e2e_paths.py`) passes only because its replayed history happens to avoid the case, and the
restart test checked counts, not tokens. Strict xfail: when the bug is fixed this XPASSes and fails, so
remove the mark then. The kill -9 suite (`test_kill_under_load.py`) finds it after every restart.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.orchestrator.engine.node_harness import md, registry, run_turn, start_node, uninterrupted_greedy


@pytest.mark.xfail(strict=True, reason="GLOBAL_REPLAY differs from the uninterrupted computation (open bug)")
@pytest.mark.parametrize("restart", [False, True], ids=["pool-dropped", "restart"])
def test_global_replay_equals_the_uninterrupted_computation(tmp_path: Path, restart: bool) -> None:
    torch.set_num_threads(1)
    node = start_node(tmp_path, registry())
    try:
        pb = node.pb
        made = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md())
        sid = made.session.session_id
        rng = random.Random(1)
        history: list[int] = []
        for n in (40, 5):
            new = [rng.randrange(16, 512) for _ in range(n)]
            history += new + run_turn(node, sid, new).tokens
        if restart:
            node.stop()
            node = start_node(tmp_path, registry())
        else:
            node.service.pool.discard_tenant("acme")
        new = [rng.randrange(16, 512) for _ in range(8)]
        t = run_turn(node, sid, new, max_new=6)
        assert t.path == "GLOBAL_REPLAY" and t.stats.counts.cached == len(history) == 51
        assert t.tokens == uninterrupted_greedy(node.service.registry, "a", history + new, 6)
    finally:
        node.stop()
