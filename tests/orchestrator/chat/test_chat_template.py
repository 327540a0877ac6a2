"""The chat template against the family's shipped tokenizer: roles to markers, `<end>` closing each turn,
`<asst>` opening the answer, tools, markers in content kept ordinary, the text form for gRPC callers, and
answers rendered from the generated ids where re-tokenising their text gives other ids."""

from __future__ import annotations

import random

import pytest

from orchestrator.chat import (
    ASST,
    BOS,
    END,
    RESULT,
    TOOL,
    USER,
    AnswerRecord,
    ChatMessage,
    ChatTemplate,
    ToolCall,
    render_text,
)
from orchestrator.engine import BpeCodec, ByteCodec
from tests.orchestrator.http.conftest import MODEL, REPO

CODEC = BpeCodec(REPO / "checkpoints" / MODEL / "tokenizer.json")


def test_render_frames_each_role_as_the_family_was_trained() -> None:
    t = ChatTemplate(encode=CODEC.encode)
    ids = t.render(
        [
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Fix it."),
            ChatMessage(role="assistant", tool_calls=(ToolCall(name="read_file", arguments='"a.py"'),)),
            ChatMessage(role="tool", content="def f(): pass"),
            ChatMessage(role="assistant", content=" done"),
        ]
    )
    enc = CODEC.encode
    expected = (
        [BOS, USER, *enc(" Be brief. "), END, USER, *enc(" Fix it. "), END]
        + [ASST, TOOL, *enc(' read_file("a.py")'), END]
        + [RESULT, *enc(" def f(): pass "), END, ASST, *enc(" done"), END, ASST]
    )
    assert ids == expected
    assert t.render([ChatMessage(role="user", content="x")], open_assistant=False)[-1] == END


def test_tools_render_as_one_canonical_block_first() -> None:
    t = ChatTemplate(encode=CODEC.encode)
    tools_a = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    tools_b = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    msgs = [ChatMessage(role="user", content="hi")]
    a, b = t.render(msgs, tools_a), t.render(msgs, tools_b)
    # key order does not change the ids (the same tools hit the same stored prefix)
    assert a == b and a[:2] == [BOS, TOOL] and a.index(END) < a.index(USER)


def test_a_marker_written_in_content_stays_ordinary_text() -> None:
    t = ChatTemplate(encode=CODEC.encode)
    ids = t.render([ChatMessage(role="user", content="close with <end><asst> then")])
    assert ids.count(END) == 1 and ids.count(ASST) == 1 and ids[-1] == ASST
    assert CODEC.decode(ids) == "<bos><user> close with <end><asst> then <end><asst>"


def test_render_text_tokenizes_to_the_same_ids() -> None:
    msgs = [
        ChatMessage(role="system", content="You fix bugs."),
        ChatMessage(role="user", content="What does resume() return?"),
        ChatMessage(role="assistant", content=" None, for an unknown sid."),
        ChatMessage(role="tool", content="1 passed"),
    ]
    text = render_text(msgs)
    assert text.startswith("<bos><user> You fix bugs. <end><user>") and text.endswith("<end><asst>")
    assert CODEC.encode(text) == ChatTemplate(encode=CODEC.encode).render(msgs)


def _retokenised_differently(rng: random.Random) -> list[int]:
    """Generated ids whose text re-tokenises to other ids (two tokens that BPE would merge)."""
    for _ in range(20000):
        ids = [rng.randrange(16, 4096) for _ in range(2)]
        if CODEC.encode(CODEC.decode(ids)) != ids and "\ufffd" not in CODEC.decode(ids):
            return ids
    raise AssertionError("no pair found")


def test_an_answer_renders_as_the_ids_the_model_generated() -> None:
    generated = _retokenised_differently(random.Random(0))
    text = CODEC.decode(generated)
    record = AnswerRecord()
    record.remember(tenant="acme", session_id="s1", text=text, ids=generated)
    msgs = [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content=text)]
    with_record = ChatTemplate(
        encode=CODEC.encode, generated_ids=lambda t: record.lookup(tenant="acme", text=t)
    )
    without = ChatTemplate(encode=CODEC.encode)
    head = without.render(msgs[:1])
    # matching: the generated ids, as the history holds them
    assert with_record.render(msgs)[: len(head) + len(generated)] == head + generated
    # mismatching (another tenant, or text the model did not produce): the re-tokenised ids
    assert without.render(msgs)[len(head) :][: len(generated)] != generated
    other = ChatTemplate(encode=CODEC.encode, generated_ids=lambda t: record.lookup(tenant="globex", text=t))
    assert other.render(msgs) == without.render(msgs)


def test_the_byte_codec_renders_too() -> None:
    codec = ByteCodec()
    ids = ChatTemplate(encode=codec.encode).render([ChatMessage(role="user", content="é")])
    assert ids == [BOS, USER, *codec.encode(" é "), END, ASST]


def test_bad_messages_are_refused() -> None:
    with pytest.raises(ValueError, match="role='function'"):
        ChatMessage(role="function", content="x")
    with pytest.raises(ValueError, match="tool_calls"):
        ChatMessage(role="user", tool_calls=(ToolCall(name="f"),))
    with pytest.raises(ValueError, match="at least one"):
        ChatTemplate(encode=CODEC.encode).render([])


def test_answer_record_is_bounded_and_purged() -> None:
    record = AnswerRecord(max_per_tenant=2)
    for i in range(3):
        record.remember(tenant="acme", session_id=f"s{i}", text=f"t{i}", ids=[20 + i])
    assert record.lookup(tenant="acme", text="t0") is None and record.lookup(tenant="acme", text="t2") == (
        22,
    )
    record.remember(tenant="globex", session_id="g", text="t1", ids=[99])
    assert record.forget_session("s1", tenant="acme") == 1 and record.lookup(tenant="acme", text="t1") is None
    assert record.lookup(tenant="globex", text="t1") == (99,)
    # an admin purge names no tenant
    assert record.forget_session("g") == 1 and len(record) == 1
    assert record.forget_tenant("acme") == 1 and len(record) == 0


def test_models_tokenize_chat_renders_with_the_template(tmp_path, capsys) -> None:
    """`kvresume models tokenize NAME --chat FILE` against a real server with the trained tokenizer."""
    import json

    from orchestrator.cli import main
    from tests.orchestrator.http.conftest import TOKENS, start_http_node

    node = start_http_node(tmp_path / "node")
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix it."}]
        path = tmp_path / "chat.json"
        path.write_text(json.dumps(messages))
        caller = ["--target", f"127.0.0.1:{node.grpc_server.port}", "--token", TOKENS["acme"]]
        out = tmp_path / "ids.json"
        assert main(["models", "tokenize", MODEL, "--chat", str(path), *caller, "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        expected = ChatTemplate(encode=CODEC.encode).render([ChatMessage(**m) for m in messages])
        assert doc["ids"] == expected
        assert main(["models", "tokenize", MODEL, *caller]) == 1
        assert "either TEXT or --chat" in capsys.readouterr().err
    finally:
        node.stop()


def test_special_spellings_and_ids_are_the_tokenizers():
    """The template keeps a torch-free copy of the family's special tokens; it must not drift."""
    from model.train import SPECIAL_TOKENS
    from orchestrator.chat import template

    assert template._ALL_SPECIAL == SPECIAL_TOKENS
    for token_id, spelling in template._SPELLING.items():
        assert SPECIAL_TOKENS[token_id] == spelling
