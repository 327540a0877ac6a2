"""The Models service over real gRPC (ListModels, GetModel, Tokenize, Detokenize), and the light client
package driving a real server from a process where torch, the model stack and SQL cannot be imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from kvresume import Client, error_details
from model import kv_bytes, load_preset
from tests.orchestrator.engine.node_harness import ADMIN, TOKENS, md, registry, start_node

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    n = start_node(tmp_path_factory.mktemp("models"), registry(), max_sessions_per_tenant=50)
    try:
        yield n
    finally:
        n.stop()


def test_list_and_get_models_say_limits_and_fingerprints(node) -> None:
    pb = node.pb
    stub = pb.models_grpc.ModelsStub(node.channel)
    listed = stub.ListModels(pb.models.ListModelsRequest(), metadata=md())
    assert [m.name for m in listed.models] == ["a", "b"]
    a = stub.GetModel(pb.models.GetModelRequest(name="a"), metadata=md())
    served = node.service.registry.get("a")
    cfg = load_preset("v41-tiny")
    assert a.fingerprint == served.fingerprint_hex and a.numerics_profile == served.numerics.label
    limits = (a.vocab_size, a.window, a.max_context_tokens)
    assert limits == (cfg.vocab_size, cfg.window_size, cfg.max_seq_len)
    assert (a.chunk_tokens, a.max_turn_tokens, a.max_new_tokens) == (32, 512, 64)
    assert a.kv_bytes_per_token == pytest.approx(float(kv_bytes(cfg).global_bytes_per_token))
    assert a.source == "random:v41-tiny@1" and a.config_name == "v41-tiny"
    # two seeds of one config are two fingerprints: their caches never hit each other
    assert listed.models[1].fingerprint != a.fingerprint
    # the admin token may read the catalogue too
    admin = (("authorization", f"Bearer {ADMIN}"),)
    assert stub.GetModel(pb.models.GetModelRequest(name="b"), metadata=admin).name == "b"
    with pytest.raises(grpc.RpcError) as info:
        stub.GetModel(pb.models.GetModelRequest(name="c"), metadata=md())
    d = error_details(info.value)
    assert (d.code, d.reason) == ("NOT_FOUND", "MODEL_NOT_SERVED") and "a, b" in d.message


def test_tokenize_matches_what_a_text_turn_appends(node) -> None:
    pb = node.pb
    stub = pb.models_grpc.ModelsStub(node.channel)
    text = "def f(x):\n    return x  # héllo"
    tok = stub.Tokenize(pb.models.TokenizeRequest(model="a", text=text), metadata=md())
    assert tok.count == len(tok.ids) > 0
    back = stub.Detokenize(pb.models.DetokenizeRequest(model="a", ids=tok.ids), metadata=md())
    assert back.text == text
    sid = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md()).session
    request = pb.sessions.TurnRequest(
        session_id=sid.session_id, text=text, generation=pb.sessions.GenerationParams(max_new_tokens=2)
    )
    events = list(node.sessions.Turn(request, metadata=md()))
    assert events[0].plan.prompt_tokens == tok.count and events[-1].stats.prompt_tokens == tok.count
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(pb.models.DetokenizeRequest(model="a", ids=[512]), metadata=md())
    d = error_details(info.value)
    assert (d.code, d.reason, d.metadata) == ("INVALID_ARGUMENT", "TOKEN_OUT_OF_VOCABULARY", {"field": "ids"})


# Run in a child process: a finder refuses the heavy modules, so importing any of them fails loudly.
_LIGHT_CLIENT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    BLOCKED = {"torch", "triton", "numpy", "sklearn", "sqlalchemy", "rocksdict", "model", "orchestrator",
               "storage", "mappers", "kernels"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked in this test: {name}")
            return None

    sys.meta_path.insert(0, Refuse())
    from kvresume import Client, error_details
    from kvresume.v1 import models_pb2, sessions_pb2

    target, token = sys.argv[1], sys.argv[2]
    out = {}
    with Client(target, token=token, timeout_s=60) as client:
        listed = client.call("models", "ListModels", models_pb2.ListModelsRequest())
        out["models"] = [m.name for m in listed.models]
        created = client.call("sessions", "CreateSession", sessions_pb2.CreateSessionRequest(model="a"))
        request = sessions_pb2.TurnRequest(
            session_id=created.session.session_id,
            tokens=sessions_pb2.TokenIds(ids=[20, 21, 22]),
            generation=sessions_pb2.GenerationParams(max_new_tokens=2),
        )
        events = list(client.call("sessions", "Turn", request))
        out["events"] = [e.WhichOneof("event") for e in events]
        try:
            client.call("sessions", "GetSession", sessions_pb2.GetSessionRequest(session_id="missing"))
        except Exception as exc:
            out["error"] = error_details(exc).as_dict()
    out["heavy_loaded"] = sorted(m for m in BLOCKED if m in sys.modules)
    print(json.dumps(out))
    """
)


def test_light_client_drives_a_server_without_the_model_stack(node) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _LIGHT_CLIENT, f"127.0.0.1:{node.server.port}", TOKENS["acme"]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["models"] == ["a", "b"]
    assert out["events"] == ["plan", "tokens", "tokens", "stats"]
    assert out["error"]["code"] == "NOT_FOUND" and out["error"]["reason"] == "SESSION_NOT_FOUND"
    assert out["heavy_loaded"] == []


def test_client_refuses_an_unknown_rpc_name() -> None:
    with Client("127.0.0.1:1", token="t") as client, pytest.raises(ValueError, match="unknown RPC"):
        client.call("sessions", "NoSuchCall", None)
