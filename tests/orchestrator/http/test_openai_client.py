"""The official `openai` client against a real node (trained v41-sib-s, SQLite, RocksDB, gRPC and HTTP on
loopback): streaming and not, usage with cached tokens on a resent history, the kvresume extension naming the
path as the gRPC enum does, tools and tool messages, /v1/completions, tenant isolation.
"""

from __future__ import annotations

import time

import httpx

from orchestrator.chat import ASST, END, ChatMessage, ChatTemplate, ToolCall
from orchestrator.engine import BpeCodec
from tests.orchestrator.http.conftest import MODEL, REPO, TOKENS, HttpNode

CODEC = BpeCodec(REPO / "checkpoints" / MODEL / "tokenizer.json")
SYSTEM = "You fix bugs in Python code. Read the file, then run the tests. " * 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def _ext(response) -> dict:
    return response.model_extra["kvresume"]


def _ask(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def _rendered(messages: list[dict]) -> list[int]:
    """The prompt ids as this test's own template instance renders them (re-tokenising every answer)."""
    template = ChatTemplate(encode=CODEC.encode)
    return template.render([ChatMessage(role=m["role"], content=m.get("content") or "") for m in messages])


def test_models_lists_the_served_model(http_node: HttpNode) -> None:
    assert [m.id for m in http_node.client().models.list()] == [MODEL]


def test_a_resent_history_under_a_prompt_cache_key_is_a_full_hit(http_node: HttpNode) -> None:
    client = http_node.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix resume()."}]
    first = _ask(client, messages, prompt_cache_key="agent-1")
    ext = _ext(first)
    assert ext["path"] == "RESUME_PATH_COLD_PREFILL" and ext["new_session"]
    assert first.usage.prompt_tokens == len(_rendered(messages)) == ext["sent_tokens"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < first.usage.completion_tokens <= 12
    answer = first.choices[0].message.content
    history = http_node.history(ext["session_id"])
    messages += [{"role": "assistant", "content": answer}, {"role": "tool", "content": "1 failed: KeyError"}]

    second = _ask(client, messages, prompt_cache_key="agent-1")
    ext2 = _ext(second)
    assert (ext2["session_id"], ext2["new_session"]) == (ext["session_id"], False)
    assert ext2["path"] == "RESUME_PATH_FULL_HIT", ext2
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        == ext2["counts"]["cached"] + ext2["counts"]["mapped"]
    )
    # only the suffix past the committed history went to the engine; usage counts the whole prompt
    assert ext2["sent_tokens"] == second.usage.prompt_tokens - len(history)
    assert second.usage.prompt_tokens == sum(ext2["counts"][k] for k in ("cached", "mapped", "prefilled"))


def test_streaming_sends_the_same_answer_in_openai_chunks_with_usage(http_node: HttpNode) -> None:
    client = http_node.client()
    messages = [{"role": "user", "content": "What does resume() return for an unknown sid?"}]
    whole = _ask(client, messages, max_tokens=16)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # greedy on a new session each time: the streamed text is the non-streamed one
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.model_extra["kvresume"]["path"] == "RESUME_PATH_COLD_PREFILL"


def test_the_raw_sse_stream_ends_with_done(http_node: HttpNode) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}
    headers = {"Authorization": f"Bearer {TOKENS['acme']}"}
    with httpx.stream(
        "POST", f"{http_node.base_url}/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_stateless_full_history_requests_reach_full_hit_from_the_second_turn(http_node: HttpNode) -> None:
    client = http_node.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the KeyError."}]
    paths, cached = [], []
    for i in range(4):
        r = _ask(client, messages)
        paths.append(_ext(r)["path"])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert _ext(r)["new_session"]
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "tool", "content": f"run {i}: 1 failed"},
        ]
    assert paths[1:] == ["RESUME_PATH_FULL_HIT"] * 3, paths
    assert all(c > 0 for c in cached[1:]), cached


def test_matching_and_mismatching_histories(http_node: HttpNode) -> None:
    """A resent answer renders as the ids the model generated (the session continues), even where
    re-tokenising its text would not; an edited answer is a new history: a new session."""
    client = http_node.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Show resume()."}]
    first = _ask(client, messages, prompt_cache_key="agent-2", max_tokens=20)
    sid = _ext(first)["session_id"]
    answer = first.choices[0].message.content
    history = http_node.history(sid)
    # the history holds `<asst>`, the generated ids (and `<end>` when the model stopped)
    generated = history[len(_rendered(messages)) :]
    generated = generated[:-1] if generated and generated[-1] == END else generated
    assert http_node.http.door.answers.lookup(tenant="acme", text=answer) == tuple(generated)
    assert CODEC.decode(generated) == answer
    matching = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    ext = _ext(_ask(client, matching, prompt_cache_key="agent-2"))
    assert (ext["session_id"], ext["new_session"], ext["path"]) == (sid, False, "RESUME_PATH_FULL_HIT")

    edited = [
        *messages,
        {"role": "assistant", "content": answer + " (edited)"},
        {"role": "user", "content": "Go on."},
    ]
    r = _ask(client, edited, prompt_cache_key="agent-2")
    ext = _ext(r)
    assert ext["new_session"] and ext["session_id"] != sid
    # content-addressed reuse: the new session shares the stored prefix up to the edit (whole chunks)
    assert r.usage.prompt_tokens_details.cached_tokens > 0, ext
    # the key now names the new session: the edited history goes on there
    assert http_node.http.door.keys.get("acme", "agent-2") == ext["session_id"]


def test_tools_and_tool_messages_are_rendered(http_node: HttpNode) -> None:
    client = http_node.client()
    messages = [
        {"role": "user", "content": "Fix resume()."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "def resume(self, sid): return self.rows[sid]"},
    ]
    r = _ask(client, messages, tools=TOOLS, prompt_cache_key="tools-1")
    # the trained family cannot produce tool calls: the answer is text
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    template = ChatTemplate(encode=CODEC.encode)
    expected = template.render(
        [
            ChatMessage(role="user", content="Fix resume()."),
            ChatMessage(
                role="assistant", tool_calls=(ToolCall(name="read_file", arguments='{"path": "a.py"}'),)
            ),
            ChatMessage(role="tool", content="def resume(self, sid): return self.rows[sid]"),
        ],
        TOOLS,
    )
    history = http_node.history(_ext(r)["session_id"])
    assert history[: len(expected)] == expected and expected[-1] == ASST
    assert r.usage.prompt_tokens == len(expected)


def test_completions_streams_and_not(http_node: HttpNode) -> None:
    client = http_node.client()
    prompt = "<user> def resume(self, sid): <end><asst>"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.usage.prompt_tokens == len(CODEC.encode(prompt))
    parts = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert whole.model_extra["kvresume"]["path"] == "RESUME_PATH_COLD_PREFILL"


def test_tenants_are_isolated_over_http(http_node: HttpNode) -> None:
    acme, globex = http_node.client("acme"), http_node.client("globex")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Isolation."}]
    a = _ask(acme, messages, prompt_cache_key="same-key")
    a_ext = _ext(a)
    messages += [
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    # acme's answer is not in globex's record (globex renders it by re-tokenising)
    assert http_node.http.door.answers.lookup(tenant="globex", text=a.choices[0].message.content) is None
    # the same key and the same conversation under another tenant: its own new session, nothing cached
    g = _ask(globex, messages, prompt_cache_key="same-key")
    g_ext = _ext(g)
    assert g_ext["new_session"] and g_ext["session_id"] != a_ext["session_id"]
    assert g.usage.prompt_tokens_details.cached_tokens == 0 and g_ext["path"] == "RESUME_PATH_COLD_PREFILL"
    # and acme still continues its own session
    assert _ext(_ask(acme, messages, prompt_cache_key="same-key"))["session_id"] == a_ext["session_id"]
    # a session id of acme's named as X-Session-Id by globex is just an unknown key there
    h = _ask(globex, messages, extra_headers={"X-Session-Id": a_ext["session_id"]})
    assert _ext(h)["new_session"] and _ext(h)["session_id"] != a_ext["session_id"]


def test_a_session_purge_clears_the_front_doors_tenant_data(http_node: HttpNode) -> None:
    client = http_node.client()
    r = _ask(client, [{"role": "user", "content": "Purge me."}], prompt_cache_key="purged")
    sid, answer = _ext(r)["session_id"], r.choices[0].message.content
    door = http_node.http.door
    assert door.keys.get("acme", "purged") == sid
    assert door.answers.lookup(tenant="acme", text=answer) is not None
    stub = http_node.pb.sessions_grpc.SessionsStub(http_node.channel)
    stub.DeleteSession(http_node.pb.sessions.DeleteSessionRequest(session_id=sid), metadata=http_node.md())
    assert door.keys.get("acme", "purged") is None
    assert all(a.session_id != sid for a in door.answers._by_tenant.get("acme", {}).values())


def test_a_keyless_request_takes_the_session_made_ahead_for_it(http_node: HttpNode) -> None:
    client = http_node.client("globex")
    spares = http_node.http.door.spares
    _ask(client, [{"role": "user", "content": "first"}])
    deadline = time.monotonic() + 30
    while ("globex", MODEL) not in spares._spare and time.monotonic() < deadline:
        time.sleep(0.01)
    spare = spares._spare[("globex", MODEL)]
    # it is a real, empty session of the tenant, and the next keyless request runs on it
    assert http_node.history(spare) == []
    assert _ext(_ask(client, [{"role": "user", "content": "second"}]))["session_id"] == spare
    # a purge of the tenant drops its spare
    while ("globex", MODEL) not in spares._spare and time.monotonic() < deadline:
        time.sleep(0.01)
    http_node.service.ctx.purger.purge_tenant("globex", actor="admin", reason="test")
    assert ("globex", MODEL) not in spares._spare
