"""`kvresume admin ...`: migrations (local), and policy, purge, audit and stats calls to a running server.

Exit 0 on success, 1 on failure (an RPC error prints its status code and details to stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc

from kvresume.client import bearer_metadata, message_json, open_channel, rpc_error_text
from orchestrator.api.stubs import load_stubs
from orchestrator.cli.serve_cmd import add_settings_flags, settings_from_args


def _migrate(args: argparse.Namespace) -> int:
    from orchestrator.db import downgrade, upgrade

    url = settings_from_args(args).resolved_database_url
    if args.admin_command == "migrate":
        upgrade(url, args.revision)
    else:
        downgrade(url, args.revision)
    print(f"database at revision {args.revision}")
    return 0


def _audit_verify_local(args: argparse.Namespace) -> int:
    from orchestrator.db import SqlAuditSink, make_engine

    engine = make_engine(settings_from_args(args).resolved_database_url)
    try:
        sink = SqlAuditSink(engine)
        result = sink.verify()
        head_seq, head_hash = sink.head()
    finally:
        engine.dispose()
    if args.json:
        import json

        print(
            json.dumps(
                {
                    "ok": result.ok,
                    "records": result.records,
                    "first_break_seq": result.first_break_seq,
                    "reason": result.reason,
                    "head_seq": head_seq,
                    "head_hash": head_hash,
                },
                sort_keys=True,
            )
        )
    else:
        state = "ok" if result.ok else f"BROKEN at seq {result.first_break_seq}: {result.reason}"
        print(f"audit chain {state}; {result.records} records, head seq {head_seq}")
    return 0 if result.ok else 1


def _calibrate(args: argparse.Namespace) -> int:
    """Measure per-token costs of a model preset on this machine and merge them into the cost table."""
    import json
    import tempfile
    from pathlib import Path

    import torch
    from rocksdict import Options, Rdict

    from kernels import dequantize_fp4_e4m3
    from model import Transformer, init_random, kv_bytes, load_preset, prefill
    from orchestrator.planner import Costs, CostTable
    from orchestrator.planner.calibration import per_token_seconds

    settings = settings_from_args(args)
    out = Path(args.out) if args.out else (settings.calibration_file or settings.data_dir / "costs.json")
    sizes = [int(x) for x in args.sizes.split(",")]
    cfg = load_preset(args.preset)
    # Costs depend on shapes, not on weight values: random weights of the preset's config suffice.
    model = init_random(Transformer(cfg), seed=0)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (1, n), generator=gen)

    def encode(n: int) -> None:
        prefill(model, tokens(n), None, mode="ced")

    def every_layer(n: int) -> None:
        prefill(model, tokens(n), None, mode="reference")

    per_token = kv_bytes(cfg)
    entry = int(per_token.global_bytes_per_token)
    n_sources = max(1, len(per_token.sources))
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        db = Rdict(tmp, options=Options(raw_mode=True))

        # Loading stored KV = reading its bytes from RocksDB and dequantizing the FP4 main KV.
        def load(n: int) -> None:
            db[b"k"] = bytes(n * entry)
            assert len(db[b"k"]) == n * entry
            packed = torch.zeros(n * n_sources, cfg.head_dim // 2, dtype=torch.uint8)
            scales = torch.ones(n * n_sources, cfg.head_dim // 16).to(torch.float8_e4m3fn)
            dequantize_fp4_e4m3(packed, scales)

        try:
            encode_s = per_token_seconds(encode, sizes, repeats=args.repeats)
            full_s = per_token_seconds(every_layer, sizes, repeats=args.repeats)
            load_s = per_token_seconds(load, [n * 16 for n in sizes], repeats=args.repeats)
        finally:
            db.close()
    # `reference` runs every layer over every token, `ced` the decoder over the last W only: the
    # difference of their slopes is the decoder half's per-token cost.
    costs = Costs(
        load_s=load_s,
        encode_s=encode_s,
        decode_replay_s=max(full_s - encode_s, 0.0),
        map_s=0.0,
        source=str(out),
    )
    table = CostTable.load(out) if out.is_file() else CostTable()
    name = args.model_name or args.preset
    table.with_model(name, costs).save(out)
    print(json.dumps({"model": name, "out": str(out), **costs.to_json()}, sort_keys=True))
    return 0


def _remote(
    build: Callable[[Any, argparse.Namespace], tuple[str, Any]], *, ok: Callable[[Any], bool] | None = None
):
    """Wrap a request builder: open a channel, call Admin.<method>, print the response."""

    def run(args: argparse.Namespace) -> int:
        pb = load_stubs()
        settings = settings_from_args(args)
        token = args.token or os.environ.get("KVRESUME_ADMIN_TOKEN", "") or settings.admin_token
        target = args.target or f"{settings.grpc_host}:{settings.grpc_port}"
        method, request = build(pb, args)
        with open_channel(target, tls_ca_file=args.tls_ca) as channel:
            stub = pb.admin_grpc.AdminStub(channel)
            try:
                response = getattr(stub, method)(
                    request, metadata=bearer_metadata(token), timeout=args.timeout
                )
            except grpc.RpcError as exc:
                print(f"kvresume admin: {rpc_error_text(exc)}", file=sys.stderr)
                return 1
        print(message_json(response))
        return 0 if ok is None or ok(response) else 1

    return run


def _retention(pb: Any, args: argparse.Namespace) -> tuple[str, Any]:
    if args.action == "get":
        return "GetRetentionPolicy", pb.admin.TenantRef(tenant_id=args.tenant)
    if args.floor_s is None or args.ceiling_s is None:
        raise ValueError("retention set needs --floor-s and --ceiling-s")
    return "SetRetentionPolicy", pb.admin.RetentionPolicy(
        tenant_id=args.tenant, floor_s=args.floor_s, ceiling_s=args.ceiling_s
    )


def _residency(pb: Any, args: argparse.Namespace) -> tuple[str, Any]:
    if args.action == "get":
        return "GetResidencyPolicy", pb.admin.TenantRef(tenant_id=args.tenant)
    regions = [r for r in (args.regions or "").split(",") if r]
    return "SetResidencyPolicy", pb.admin.ResidencyPolicy(tenant_id=args.tenant, allowed_regions=regions)


def _purge(pb: Any, args: argparse.Namespace) -> tuple[str, Any]:
    if args.session:
        return "Purge", pb.admin.PurgeRequest(session_id=args.session)
    if args.model:
        return "Purge", pb.admin.PurgeRequest(model=args.model, model_tenant_id=args.tenant or "")
    if args.tenant:
        return "Purge", pb.admin.PurgeRequest(tenant_id=args.tenant)
    raise ValueError("purge needs --session, --tenant, or --model")


def _audit(pb: Any, args: argparse.Namespace) -> tuple[str, Any]:
    if args.action == "verify":
        return "VerifyAudit", pb.admin.VerifyAuditRequest()
    return "QueryAudit", pb.admin.QueryAuditRequest(
        tenant_id=args.tenant or "", action=args.event or "", after_seq=args.after_seq, limit=args.limit
    )


def _stats(pb: Any, args: argparse.Namespace) -> tuple[str, Any]:
    return "GetStoreStats", pb.admin.StoreStatsRequest(tenant_id=args.tenant or "")


def _remote_flags(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser)
    parser.add_argument("--target", help="server host:port (default: the settings' address)")
    parser.add_argument("--token", help="admin token (default: $KVRESUME_ADMIN_TOKEN or the settings')")
    parser.add_argument("--tls-ca", help="CA bundle for a TLS server")
    parser.add_argument("--timeout", type=float, default=30.0, help="RPC deadline in seconds")
    parser.add_argument("--json", action="store_true", help="JSON output (the default for RPC responses)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("admin", help="registry migrations, policies, purge, audit, stats")
    sub = parser.add_subparsers(dest="admin_command", required=True)

    for name, help_text in (
        ("migrate", "upgrade the registry schema"),
        ("downgrade", "downgrade the schema"),
    ):
        p = sub.add_parser(name, help=help_text)
        add_settings_flags(p)
        p.add_argument(
            "--revision", default="head" if name == "migrate" else None, required=name == "downgrade"
        )
        p.set_defaults(handler=_migrate)

    p = sub.add_parser("retention", help="get or set a tenant's retention floor and ceiling")
    _remote_flags(p)
    p.add_argument("action", choices=["get", "set"])
    p.add_argument("--tenant", required=True)
    p.add_argument("--floor-s", type=float)
    p.add_argument("--ceiling-s", type=float)
    p.set_defaults(handler=_remote(_retention))

    p = sub.add_parser("residency", help="get or set the regions where a tenant's KV may be stored")
    _remote_flags(p)
    p.add_argument("action", choices=["get", "set"])
    p.add_argument("--tenant", required=True)
    p.add_argument("--regions", help="comma-separated region labels (empty: anywhere)")
    p.set_defaults(handler=_remote(_residency))

    p = sub.add_parser("purge", help="delete a session, a tenant, or a model's stored KV")
    _remote_flags(p)
    p.add_argument("--session")
    p.add_argument("--tenant", help="purge this tenant (or, with --model, restrict to it)")
    p.add_argument("--model")
    p.set_defaults(handler=_remote(_purge))

    p = sub.add_parser("audit", help="query or verify the audit chain through the server")
    _remote_flags(p)
    p.add_argument("action", choices=["verify", "query"])
    p.add_argument("--tenant")
    p.add_argument("--event", help="audit action to filter on (store, purge, policy_change, ...)")
    p.add_argument("--after-seq", type=int, default=0)
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(handler=_remote(_audit, ok=lambda r: getattr(r, "ok", True)))

    p = sub.add_parser("audit-local", help="verify the audit chain directly in the registry database")
    add_settings_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_audit_verify_local)

    p = sub.add_parser("calibrate", help="measure per-token costs of a model and store them for the planner")
    add_settings_flags(p)
    p.add_argument("--preset", required=True, help="model preset (for example v41-tiny)")
    p.add_argument("--model-name", help="name the planner knows the model by (default: the preset)")
    p.add_argument(
        "--out", help="cost table JSON (default: settings.calibration_file or data_dir/costs.json)"
    )
    p.add_argument("--sizes", default="32,64,128", help="comma-separated token counts to time")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(handler=_calibrate)

    p = sub.add_parser("stats", help="store statistics")
    _remote_flags(p)
    p.add_argument("--tenant")
    p.set_defaults(handler=_remote(_stats))
