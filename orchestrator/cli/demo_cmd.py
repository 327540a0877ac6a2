"""`kvresume demo`: an embedded server and one scripted agent session driven over gRPC on loopback.

The script: a long first prompt, tool-result turns, an idle gap that expires the window pool (simulated
with the pool's injected clock, so the demo does not sleep ten minutes), an admin purge of the model's
stored KV, a switch to a sibling model, and a turn on the sibling. The switch goes to the sibling that a
shipped mapper from the first model passed its gate for (`checkpoints/mappers/`), so it is a MODEL_SWAP
of the mapped history; without one it goes to the second served model and is a cold prefill. It prints
one row per turn (path, model, reason, tokens by kind, time to first token) and, with --json, the list
of turns (server install; the model stack is imported when the demo runs).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli.numerics_flag import add_numerics_flag, enter_numerics
from orchestrator.cli.output import add_json_flag, text_stream, write_json
from orchestrator.numerics_env import describe, profile_report
from orchestrator.settings import Settings

if TYPE_CHECKING:
    from orchestrator.engine import KVMapperApplier, ModelRegistry

__all__ = ["DemoTurn", "EXPECTED_PATHS", "expected_paths", "run_demo"]

_TENANT, _TOKEN, _ADMIN = "demo-tenant", "demo-token", "demo-admin-token"
_POOL_TTL_S = 600.0

_SYSTEM = (
    "You are a coding agent working in a Python repository. Tools: read_file(path), run_tests(), "
    "edit(path, diff). Keep answers short. The user reports that the session store loses turns after "
    "a restart, and the failing test is tests/test_resume.py::test_restart_keeps_history. "
)

_FILE = (
    "<tool> read_file('store/sessions.py') <result> class SessionStore:\n"
    "    def __init__(self, path):\n        self.path = path\n        self.rows = {}\n\n"
    "    def save(self, sid, turns):\n        self.rows[sid] = list(turns)\n\n"
    "    def load(self):\n        with open(self.path) as fh:\n            for line in fh:\n"
    "                sid, _, turns = line.partition(' ')\n"
    "                self.rows[sid] = turns.split(',')\n\n"
    "    def resume(self, sid):\n        return self.rows.get(sid)\n <end> "
)


@dataclass(frozen=True, kw_only=True)
class _Step:
    label: str
    text: str
    model: str = ""
    before: str = ""


def _script(first: str, second: str) -> tuple[_Step, ...]:
    return (
        _Step(label="user: task", text=_SYSTEM + _FILE + "Please find the bug and fix it."),
        _Step(
            label="tool: read_file", text="<result> def resume(self, sid):  return self.rows.get(sid) <end> "
        ),
        _Step(label="tool: run_tests", text="<result> 1 failed: KeyError 'sid-42' in resume() <end>"),
        _Step(label="user: after idle", text="I am back. What did you find?", before="idle"),
        _Step(label="user: after purge", text="Summarise the fix in one line.", before="purge"),
        _Step(label="user: on sibling", text="Now write the commit message.", model=second),
        _Step(label="tool: run_tests", text="<result> all 12 passed <end>", model=second),
    )


EXPECTED_PATHS = (
    "COLD_PREFILL",
    "FULL_HIT",
    "FULL_HIT",
    "GLOBAL_REPLAY",
    "COLD_PREFILL",
    "COLD_PREFILL",
    "FULL_HIT",
)
_SWITCH_TURN = 5


def expected_paths(*, mapped_switch: bool) -> tuple[str, ...]:
    """The script's paths; the switch is a MODEL_SWAP when a mapper for the pair passed its gate."""
    paths = list(EXPECTED_PATHS)
    if mapped_switch:
        paths[_SWITCH_TURN] = "MODEL_SWAP"
    return tuple(paths)


# Siblings grown from v41-sib-s (checkpoints/<name>/README.md): the pairs the shipped mappers connect.
_GROWN_SIBLINGS = ("v41-sib-m", "v41-sib-m2")


def demo_sources(root: Path | None = None) -> dict[str, str]:
    """The demo's served models: the default siblings, plus each grown sibling whose checkpoint is
    shipped (the pairs a shipped mapper connects); empty (the defaults) when none is."""
    from orchestrator.engine import default_model_specs, repo_root

    specs = default_model_specs(root)
    base = (root or repo_root()) / "checkpoints"
    grown = {name: base / name for name in _GROWN_SIBLINGS if (base / name / "config.json").is_file()}
    if any(s.is_stand_in for s in specs.values()) or not grown:
        return {}
    sources = {name: f"checkpoint:{spec.checkpoint}" for name, spec in specs.items()}
    return sources | {name: f"checkpoint:{path}" for name, path in grown.items()}


def switch_target(first: str, names: Sequence[str], mapper_dirs: Sequence[Path]) -> str | None:
    """The served model a shipped, gate-passing mapper from `first` leads to (None: there is none)."""
    from orchestrator.engine import registration_of

    for directory in mapper_dirs:
        fields = registration_of(directory)
        if fields["sender_model"] == first and fields["receiver_model"] in names and fields["passed_gate"]:
            return str(fields["receiver_model"])
    return None


def shipped_mapper_dirs(root: Path | None = None) -> list[Path]:
    """Mapper artifacts shipped under `checkpoints/mappers/<name>/` (each with a mapper.json)."""
    from orchestrator.engine import repo_root

    base = (root or repo_root()) / "checkpoints" / "mappers"
    return sorted(p.parent for p in base.glob("*/mapper.json"))


@dataclass(frozen=True, kw_only=True)
class DemoTurn:
    turn: int
    step: str
    path: str
    model: str
    reason: str
    new_tokens: int
    cached: int
    replayed_encoder: int
    replayed_decoder: int
    prefilled: int
    mapped: int
    generated: int
    ttft_ms: float
    persisted: bool


def run_demo(
    data_dir: Path,
    *,
    registry: ModelRegistry | None = None,
    mappers: KVMapperApplier | None = None,
    max_new_tokens: int = 8,
    on_turn: Callable[[DemoTurn], None] | None = None,
    mapper_dirs: Sequence[Path] = (),
    on_mapper: Callable[[dict[str, Any]], None] | None = None,
    switch_to: str | None = None,
) -> list[DemoTurn]:
    """Run the scripted session against an embedded server whose state lives under `data_dir`.

    Args:
        mapper_dirs: mapper artifacts to register through the Mappers API first (those whose pair is
            not served here are skipped); `on_mapper` sees each registration's fields.
        switch_to: the model of the switch (default: the second served model).
    """
    import grpc

    from orchestrator.api import build_server
    from orchestrator.engine import build_node, registration_of
    pool_now = [0.0]
    settings = Settings(
        data_dir=data_dir,
        tenant_tokens={_TENANT: _TOKEN},
        admin_token=_ADMIN,
        grpc_port=0,
        metrics_enabled=False,
        kv_chunk_tokens=64,
        pool_ttl_s=_POOL_TTL_S,
        pool_budget_bytes=256 * 1024 * 1024,
    )
    node = build_node(
        settings, registry=registry, mappers=mappers, pool_clock=lambda: pool_now[0], preload=True
    )
    names = node.registry.names
    first = names[0]
    second = switch_to or (names[1] if len(names) > 1 else names[0])
    if second not in names:
        raise ValueError(f"switch_to={second!r} is not served here ({list(names)})")
    script = _script(first, second)
    server = build_server(node.ctx, host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    pb = node.ctx.stubs
    sessions = pb.sessions_grpc.SessionsStub(channel)
    admin = pb.admin_grpc.AdminStub(channel)
    mappers_stub = pb.mappers_grpc.MappersStub(channel)
    md = (("authorization", f"Bearer {_TOKEN}"),)
    admin_md = (("authorization", f"Bearer {_ADMIN}"),)
    turns: list[DemoTurn] = []
    try:
        for directory in mapper_dirs:
            fields = registration_of(directory)
            if {fields["sender_model"], fields["receiver_model"]} - set(names):
                continue
            threshold = fields.pop("gate_threshold")
            message = pb.mappers.Mapper(**fields)
            if threshold is not None:
                message.gate_threshold = threshold
            mappers_stub.RegisterMapper(pb.mappers.RegisterMapperRequest(mapper=message), metadata=admin_md)
            if on_mapper is not None:
                on_mapper(fields | {"gate_threshold": threshold})
        session = sessions.CreateSession(pb.sessions.CreateSessionRequest(model=first), metadata=md).session
        current = first
        for i, step in enumerate(script):
            if step.before == "idle":
                # An idle gap longer than the pool's TTL: the windows expire, the stored global KV stays.
                pool_now[0] += _POOL_TTL_S + 60.0
            elif step.before == "purge":
                admin.Purge(pb.admin.PurgeRequest(model=current), metadata=admin_md)
            current = step.model or current
            request = pb.sessions.TurnRequest(
                session_id=session.session_id,
                text=step.text,
                model=step.model,
                generation=pb.sessions.GenerationParams(max_new_tokens=max_new_tokens),
            )
            plan = stats = None
            for event in sessions.Turn(request, metadata=md):
                which = event.WhichOneof("event")
                if which == "plan":
                    plan = event.plan
                elif which == "stats":
                    stats = event.stats
            assert plan is not None and stats is not None
            c = stats.counts
            row = DemoTurn(
                turn=i,
                step=step.label,
                path=pb.common.ResumePath.Name(plan.path).removeprefix("RESUME_PATH_"),
                model=plan.model,
                reason=plan.reason,
                new_tokens=int(c.cached + c.mapped + c.prefilled) - _history(turns),
                cached=c.cached,
                replayed_encoder=c.replayed_encoder,
                replayed_decoder=c.replayed_decoder,
                prefilled=c.prefilled,
                mapped=c.mapped,
                generated=stats.generated_tokens,
                ttft_ms=round(stats.ttft_s * 1000.0, 1),
                persisted=stats.persisted,
            )
            turns.append(row)
            if on_turn is not None:
                on_turn(row)
    finally:
        channel.close()
        server.stop(grace_s=None)
        node.close()
    return turns


def _history(turns: Sequence[DemoTurn]) -> int:
    if not turns:
        return 0
    last = turns[-1]
    return last.cached + last.mapped + last.prefilled + last.generated


_COLUMNS = (
    ("turn", 4),
    ("step", 17),
    ("path", 13),
    ("model", 10),
    ("new", 5),
    ("cached", 6),
    ("rep_enc", 7),
    ("rep_dec", 7),
    ("prefill", 7),
    ("mapped", 6),
    ("gen", 4),
    ("ttft_ms", 8),
)


def _row_text(t: DemoTurn) -> str:
    values = (
        t.turn,
        t.step,
        t.path,
        t.model,
        t.new_tokens,
        t.cached,
        t.replayed_encoder,
        t.replayed_decoder,
        t.prefilled,
        t.mapped,
        t.generated,
        f"{t.ttft_ms:.1f}",
    )
    cells = " ".join(f"{str(v):<{w}}" for v, (_, w) in zip(values, _COLUMNS, strict=True))
    return f"{cells}  {t.reason}"


def _run(args: argparse.Namespace) -> int:
    rc = enter_numerics(args, args.numerics)
    if rc is not None:
        return rc
    from model import configure_torch
    from orchestrator.api import configure_logging
    from orchestrator.engine import ModelRegistry

    configure_logging(level=40 if not args.verbose else 20)
    # One intra-op thread: small passes on a few shared cores run far faster without oversubscription.
    configure_torch(args.numerics, threads=args.threads)
    own_dir = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="kvresume-demo-")) if own_dir else Path(args.data_dir)
    registry = ModelRegistry.from_sources(demo_sources(), cpu_path=args.numerics)
    mapper_dirs = [Path(d) for d in args.mapper] if args.mapper else shipped_mapper_dirs()
    names = registry.names
    target = switch_target(names[0], names, mapper_dirs) or (names[1] if len(names) > 1 else names[0])
    registered: list[dict[str, Any]] = []
    out = text_stream(args.json)
    print("kvresume demo: one agent session over gRPC on loopback", file=out)
    print(describe(profile_report(args.numerics)), file=out)
    print("models:", file=out)
    for name in registry.names:
        spec = registry.spec(name)
        assert spec is not None
        label = " (random-init stand-in: no trained checkpoint yet)" if spec.is_stand_in else ""
        print(f"  {name}: {spec.source}{label}", file=out)
    print(" ".join(f"{name:<{w}}" for name, w in _COLUMNS) + "  reason", file=out)
    started = time.perf_counter()
    lock = threading.Lock()

    def show(t: DemoTurn) -> None:
        with lock:
            print(_row_text(t), file=out, flush=True)

    def on_mapper(fields: dict[str, Any]) -> None:
        registered.append(fields)
        verdict = "passed" if fields["passed_gate"] else "did not pass"
        metric = fields["gate_metric"]
        gate = f"{metric} >= {fields['gate_threshold']}" if metric else "no gate"
        print(f"registered mapper {fields['mapper_id']} ({gate}): {verdict}", file=out, flush=True)

    try:
        turns = run_demo(
            data_dir,
            registry=registry,
            max_new_tokens=args.max_new_tokens,
            on_turn=show,
            mapper_dirs=mapper_dirs,
            on_mapper=on_mapper,
            switch_to=target,
        )
    finally:
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    paths = tuple(t.path for t in turns)
    switch = (names[0], target) if len(names) > 1 else None
    expected = expected_paths(
        mapped_switch=any(
            (m["sender_model"], m["receiver_model"]) == switch and m["passed_gate"] for m in registered
        )
    )
    print(f"{len(turns)} turns in {time.perf_counter() - started:.1f} s", file=out)
    write_json([asdict(t) for t in turns], args.json)
    if paths != expected:
        print(
            f"kvresume demo: paths {list(paths)} differ from the script's {list(expected)}",
            file=sys.stderr,
        )
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the scripted end-to-end demo (server)")
    add_json_flag(parser, what="the list of turns")
    parser.add_argument("--data-dir", help="keep the demo's registry and store here (default: a temp dir)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per turn")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--mapper",
        action="append",
        help="a mapper artifact directory to register before the session (repeatable; default: those "
        "shipped under checkpoints/mappers/)",
    )
    parser.add_argument("--verbose", action="store_true", help="service log lines on stderr")
    add_numerics_flag(parser, default="auto", what="the demo's models")
    parser.set_defaults(handler=_run)
