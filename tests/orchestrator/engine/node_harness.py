"""A real serving node for tests: SQLite file (or a PostgreSQL schema) migrated to head, RocksDB store and
window pool under tmp_path, the turn engine over seeded random-init models, gRPC on loopback port 0.

The pool's clock is a manual one the test advances (pool expiry without sleeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from model import decode, greedy, prefill
from orchestrator.api import RunningServer, build_server
from orchestrator.engine import ModelRegistry, NodeService, ServedModelSpec, build_node, repo_root
from orchestrator.settings import Settings

TOKENS = {"acme": "tok-acme", "globex": "tok-globex"}
ADMIN = "tok-admin"
WINDOW = 32
POOL_TTL_S = 600.0


def trained_registry(name: str) -> ModelRegistry:
    """One shipped trained sibling (1 torch thread), or a skip naming the missing checkpoint."""
    ckpt = repo_root() / "checkpoints" / name
    if not (ckpt / "model.safetensors").is_file():
        pytest.skip(f"{ckpt} is not shipped in this checkout")
    torch.set_num_threads(1)
    return ModelRegistry({name: ServedModelSpec(name=name, checkpoint=ckpt)})


def trained_ids(rng: Any, n: int, vocab: int = 4096) -> list[int]:
    """n ordinary token ids of the trained vocabulary (0-15 are the family's special tokens)."""
    return [rng.randrange(16, vocab) for _ in range(n)]


def new_session(node: Node, model: str, tenant: str = "acme") -> str:
    created = node.sessions.CreateSession(
        node.pb.sessions.CreateSessionRequest(model=model), metadata=md(tenant)
    )
    return created.session.session_id


def registry() -> ModelRegistry:
    """Two seeded random-init models of one geometry (v41-tiny: W=32, ratios 2 and 1, vocab 512)."""
    return ModelRegistry(
        {
            "a": ServedModelSpec(name="a", config="v41-tiny", seed=1),
            "b": ServedModelSpec(name="b", config="v41-tiny", seed=2),
        }
    )


@dataclass
class ManualClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    service: NodeService
    server: RunningServer
    channel: grpc.Channel
    pool_clock: ManualClock
    pb: Any = field(init=False)

    def __post_init__(self) -> None:
        self.pb = self.service.ctx.stubs

    @property
    def sessions(self) -> Any:
        return self.pb.sessions_grpc.SessionsStub(self.channel)

    @property
    def admin(self) -> Any:
        return self.pb.admin_grpc.AdminStub(self.channel)

    @property
    def mappers(self) -> Any:
        return self.pb.mappers_grpc.MappersStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace_s=None)
        self.service.close()


def start_node(
    data_dir: Path,
    models: ModelRegistry,
    *,
    database_url: str | None = None,
    region: str = "eu-1",
    prefill_chunk_tokens: int = 1024,
    model_cpus: Any = (),
    preload: bool = False,
    **settings: Any,
) -> Node:
    s = Settings(
        data_dir=data_dir,
        database_url=database_url or f"sqlite:///{data_dir / 'registry.sqlite3'}",
        tenant_tokens=TOKENS,
        admin_token=ADMIN,
        grpc_port=0,
        metrics_enabled=False,
        region=region,
        kv_chunk_tokens=32,
        pool_ttl_s=POOL_TTL_S,
        pool_budget_bytes=64 << 20,
        max_turn_tokens=512,
        max_new_tokens=64,
        **settings,
    )
    clock = ManualClock()
    service = build_node(
        s,
        registry=models,
        pool_clock=clock,
        prefill_chunk_tokens=prefill_chunk_tokens,
        model_cpus=model_cpus,
        preload=preload,
    )
    server = build_server(service.ctx, host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return Node(service=service, server=server, channel=channel, pool_clock=clock)


def finishes_in_the_writer_process(node: Node) -> None:
    """Every finish of `node` in its registry writer process (when it has one), a lone turn's too, from
    the first turn on: by default a lone turn's runs in its own thread, and the process starts only at
    the first concurrent turns."""
    engine = node.service.engine
    engine.writer_from_running = 1
    if engine.registry_writer is not None:
        engine.registry_writer.start()


def md(tenant: str = "acme") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def admin_md() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {ADMIN}"),)


@dataclass(frozen=True)
class TurnResult:
    path: str
    plan: Any
    stats: Any
    tokens: list[int]


def run_turn(
    node: Node, session_id: str, ids: list[int], *, model: str = "", tenant: str = "acme", max_new: int = 3
) -> TurnResult:
    pb = node.pb
    request = pb.sessions.TurnRequest(
        session_id=session_id,
        tokens=pb.sessions.TokenIds(ids=ids),
        model=model,
        generation=pb.sessions.GenerationParams(max_new_tokens=max_new),
    )
    plan = stats = None
    out: list[int] = []
    for event in node.sessions.Turn(request, metadata=md(tenant)):
        which = event.WhichOneof("event")
        if which == "plan":
            plan = event.plan
        elif which == "tokens":
            out += list(event.tokens.ids)
        else:
            stats = event.stats
    assert plan is not None and stats is not None
    path = pb.common.ResumePath.Name(plan.path).removeprefix("RESUME_PATH_")
    return TurnResult(path=path, plan=plan, stats=stats, tokens=out)


def counts(msg: Any) -> dict[str, int]:
    return {
        k: int(getattr(msg, k))
        for k in ("cached", "replayed_encoder", "replayed_decoder", "prefilled", "mapped")
    }


def uninterrupted_greedy(models: ModelRegistry, name: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of a cold `ced` prefill of the whole prompt followed by decode steps (the reference a
    full hit must equal bit for bit)."""
    served = models.get(name)
    assert served is not None
    return greedy(served.model, torch.tensor([prompt]), n)


@torch.inference_mode()
def continued_greedy(models: ModelRegistry, name: str, turns: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy tokens of a session that keeps its state in memory from turn to turn (ARCHITECTURE §1: the
    computation a full hit must equal bit for bit): each turn's new tokens prefilled (`ced`) onto the
    state, `n` tokens decoded, and the last one run through the model too, as the service does before it
    stores the turn. `turns`: (new tokens, generated count) per turn."""
    served = models.get(name)
    assert served is not None
    model, state, history, out = served.model, None, 0, []
    for new, n in turns:
        history += len(new)
        step = prefill(model, torch.tensor([new]), state, mode="ced", prompt_end=history)
        state, logits, tokens = step.state, step.logits, []
        for _ in range(n):
            tokens.append(int(logits[0].argmax()))
            step = decode(model, torch.tensor([tokens[-1]]), state)
            state, logits = step.state, step.logits
        history += n
        out.append(tokens)
    return out


def replay_start(stored: int, window: int = WINDOW, group: int = 2) -> int:
    start = max(0, stored - window)
    return start - start % group
