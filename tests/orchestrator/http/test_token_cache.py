"""The token cache answers as the tokenizer does (its slow twin) on fresh random texts, is bounded, keeps
tenants and models apart, and is cleared by purges."""

from __future__ import annotations

import random

from orchestrator.engine import BpeCodec
from orchestrator.http.token_cache import TokenCache
from tests.orchestrator.http.conftest import MODEL, REPO, HttpNode

CODEC = BpeCodec(REPO / "checkpoints" / MODEL / "tokenizer.json")
WORDS = ["def", "resume", "(self,", "sid):", "return", "self.rows", "[sid]", "KeyError", "é", "\n", "    "]


def test_cached_ids_equal_the_tokenizers_on_random_texts() -> None:
    rng = random.Random(7)
    cache = TokenCache(max_per_tenant=8)
    calls: list[str] = []

    def counted(text: str) -> list[int]:
        calls.append(text)
        return CODEC.encode(text)

    enc = cache.encoder("acme", MODEL, counted)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60))) for _ in range(40)]
    for text in texts + texts[-5:]:
        assert enc(text) == CODEC.encode(text)
    long_texts = texts
    # the last five were answered from the cache
    assert len(calls) == len(set(texts))
    assert len(cache) == 8
    # another tenant, or another model, does not read acme's entries
    other = cache.encoder("globex", MODEL, counted)
    before = len(calls)
    other(long_texts[-1])
    cache.encoder("acme", "other-model", counted)(long_texts[-1])
    assert len(calls) == before + 2
    cache.forget_tenant("acme")
    assert len(cache) == 1
    cache.forget_tenant(None)
    assert len(cache) == 0


def test_a_session_purge_clears_the_tenants_token_cache(http_node: HttpNode) -> None:
    client = http_node.client()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x" * 100}], max_tokens=2, prompt_cache_key="tc"
    )
    tokens = http_node.http.door.tokens
    assert "acme" in tokens._by_tenant
    sid = r.model_extra["kvresume"]["session_id"]
    stub = http_node.pb.sessions_grpc.SessionsStub(http_node.channel)
    stub.DeleteSession(http_node.pb.sessions.DeleteSessionRequest(session_id=sid), metadata=http_node.md())
    assert "acme" not in tokens._by_tenant
