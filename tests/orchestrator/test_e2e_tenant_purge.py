"""Admin `Purge` of one tenant's model over real gRPC: the registry rows and the stored bytes of that
tenant's chunks go (grepped out of the store's files), the other tenant's chunks of the same model stay.

Narration (model "a": seeded random-init v41-tiny, chunks of 32 tokens): tenants acme and globex each
run one 70-token turn on "a" (two full chunks and a tail stored each) -> a slice of acme's first stored
payload is on disk -> the admin purges model "a" for acme only -> acme's chunks and rows are gone, the
slice is in no file under the store root, globex still resumes its prefix from the store.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from sqlalchemy import select

from orchestrator.db.models import CacheSegment
from tests.orchestrator.engine.node_harness import admin_md, md, registry, run_turn, start_node


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def _files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def _segments(node, tenant: str) -> int:
    with node.service.ctx.sessions() as s:
        return len(list(s.scalars(select(CacheSegment).where(CacheSegment.tenant_id == tenant))))


def test_purge_model_for_one_tenant_over_grpc(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    node = start_node(tmp_path, registry())
    try:
        pb = node.pb
        store = node.service.store
        fp = node.service.registry.get("a").fingerprint_hex
        histories: dict[str, list[int]] = {}
        for seed, tenant in ((1, "acme"), (2, "globex")):
            sid = node.sessions.CreateSession(
                pb.sessions.CreateSessionRequest(model="a"), metadata=md(tenant)
            ).session.session_id
            prompt = _ids(seed, 70)
            t = run_turn(node, sid, prompt, tenant=tenant, max_new=1)
            assert t.path == "COLD_PREFILL" and t.stats.persisted
            histories[tenant] = prompt + t.tokens
        before = {tenant: store.tenant_stats(tenant).chunks for tenant in histories}
        assert before["acme"] >= 2 and before["globex"] >= 2
        assert _segments(node, "acme") >= 2
        stored = store.longest_valid_prefix("acme", fp, histories["acme"])
        assert stored.n_tokens >= 64
        # 64 bytes from the middle of acme's first chunk payload (FP4 codes of random-init KV).
        needle = stored.payloads[0][100:164]
        store._db.flush(True)
        root = tmp_path / "kv"
        assert _files_containing(root, needle), "acme's payload must be on disk before the purge"

        out = node.admin.Purge(pb.admin.PurgeRequest(model="a", model_tenant_id="acme"), metadata=admin_md())
        assert out.segments_deleted >= 2 and out.bytes_deleted > 0

        assert store.tenant_stats("acme").chunks == 0 and _segments(node, "acme") == 0
        assert store.longest_valid_prefix("acme", fp, histories["acme"]).n_tokens == 0
        assert _files_containing(root, needle) == []
        assert store.tenant_stats("globex").chunks == before["globex"]
        assert _segments(node, "globex") >= 2
        assert store.longest_valid_prefix("globex", fp, histories["globex"]).n_tokens >= 64
    finally:
        node.stop()
