"""`kvresume admin ...`: the Admin calls to a running server (retention, residency, purge, audit, stats;
client: the light `kvresume` package only), and local work on this node's registry and cost table
(migrate, downgrade, audit-local, calibrate; server install).

An RPC's answer prints as text, or as JSON with `--json`. `residency set` prints the server's warning
(the policy excludes the answering node's region: its turns for the tenant stop persisting) on stderr in
every mode; the JSON keeps it in `warning`. `audit verify` exits 1 when the chain is broken.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from orchestrator.cli import admin_store_cmd
from orchestrator.cli.connection import ADMIN, add_connection_flags, connect
from orchestrator.cli.output import add_json_flag, fields_text, table_text, text_stream, write_json
from orchestrator.cli.settings_flags import add_settings_flags, settings_from_args


def _migrate(args: argparse.Namespace) -> int:
    from orchestrator.db import downgrade, upgrade

    url = settings_from_args(args).resolved_database_url
    if args.admin_command == "migrate":
        upgrade(url, args.revision)
    else:
        downgrade(url, args.revision)
    print(f"database at revision {args.revision}", file=text_stream(args.json))
    write_json({"revision": args.revision}, args.json)
    return 0


def _audit_verify_local(args: argparse.Namespace) -> int:
    """The whole audit check without a server: the registry's chains, this node's store chain (opened
    read-only) and, with `audit_anchor_key_file`, its anchors; the same verdict and text as `audit verify`."""
    from orchestrator.db import AuditChecker, SqlAuditSink, heads_digest, make_engine
    from storage import AnchorFile, AnchorKey, read_only_audit

    settings = settings_from_args(args)
    key_file = settings.audit_anchor_key_file
    key = AnchorKey.from_file(key_file) if key_file is not None else None
    engine = make_engine(settings.resolved_database_url)
    try:
        with read_only_audit(settings.data_dir / "kv" / "db") as store:
            checker = AuditChecker(
                SqlAuditSink(engine),
                store_audit=store[0] if store is not None else None,
                store_acked_seq=lambda: store[1] if store is not None else 0,
                anchor_file=AnchorFile(settings.audit_anchor_file) if key is not None else None,
                key=key,
                node=settings.resolved_node_name,
                interval_s=settings.audit_anchor_interval_s,
                live_store=False,
            )
            report = checker.verify()
    finally:
        engine.dispose()

    def verdict(v: Any) -> dict[str, Any]:
        out = {"chain": v.chain, "ok": v.result.ok, "records": v.result.records, "reason": v.result.reason,
               "head_seq": v.head_seq, "head_hash": v.head_hash}
        if v.result.first_break_seq is not None:
            out["first_break_seq"] = v.result.first_break_seq
        return out

    doc: dict[str, Any] = {
        "ok": report.ok,
        "verdict": report.verdict,
        "records": sum(v.result.records for v in report.sql),
        "head_seq": sum(v.head_seq for v in report.sql),
        "head_hash": heads_digest({v.chain: (v.head_seq, v.head_hash) for v in report.sql}),
        "chains": [verdict(v) for v in report.sql],
        "problems": report.problems,
        "anchors": report.anchors,
        "store_records_pending": report.store_pending,
        "reason": report.problems[0] if report.problems else "",
    }
    if report.store is not None:
        doc["store_chain"] = verdict(report.store)
    broken = [v for v in [*report.sql, *([report.store] if report.store else [])] if not v.result.ok]
    if broken:
        doc["first_break_chain"] = broken[0].chain
        doc["reason"] = broken[0].result.reason
        if broken[0].result.first_break_seq is not None:
            doc["first_break_seq"] = broken[0].result.first_break_seq
    print(_audit_text(doc), file=text_stream(args.json))
    write_json(doc, args.json)
    return 0 if report.ok else 1


def _calibrate(args: argparse.Namespace) -> int:
    """Measure per-token costs of a model preset on this machine and merge them into the cost table."""
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
    doc = {"model": name, "out": str(out), **costs.to_json()}
    print(f"per-token costs of {name} written to {out}:\n{fields_text(costs.to_json())}",
          file=text_stream(args.json))
    write_json(doc, args.json)
    return 0


def _retention(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import admin_pb2

    if args.action == "get":
        return "GetRetentionPolicy", admin_pb2.TenantRef(tenant_id=args.tenant)
    if args.floor_s is None or args.ceiling_s is None:
        raise ValueError("retention set needs --floor-s and --ceiling-s")
    return "SetRetentionPolicy", admin_pb2.RetentionPolicy(
        tenant_id=args.tenant, floor_s=args.floor_s, ceiling_s=args.ceiling_s
    )


def _residency(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import admin_pb2

    if args.action == "get":
        return "GetResidencyPolicy", admin_pb2.TenantRef(tenant_id=args.tenant)
    if args.regions is None:
        raise ValueError("residency set needs --regions (an empty value means anywhere)")
    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    return "SetResidencyPolicy", admin_pb2.ResidencyPolicy(tenant_id=args.tenant, allowed_regions=regions)


def _purge(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import admin_pb2

    if args.session:
        return "Purge", admin_pb2.PurgeRequest(session_id=args.session)
    if args.model:
        return "Purge", admin_pb2.PurgeRequest(model=args.model, model_tenant_id=args.tenant or "")
    if args.tenant:
        return "Purge", admin_pb2.PurgeRequest(tenant_id=args.tenant)
    raise ValueError("purge needs --session, --tenant, or --model")


def _audit(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import admin_pb2

    if args.action == "verify":
        return "VerifyAudit", admin_pb2.VerifyAuditRequest()
    return "QueryAudit", admin_pb2.QueryAuditRequest(
        tenant_id=args.tenant or "", action=args.event or "", after_seq=args.after_seq, limit=args.limit
    )


def _stats(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import admin_pb2

    return "GetStoreStats", admin_pb2.StoreStatsRequest(tenant_id=args.tenant or "")


def _policy_text(doc: dict[str, Any]) -> str:
    default = " (service default)" if doc.get("is_default") else ""
    if "allowed_regions" in doc:
        regions = ", ".join(doc["allowed_regions"]) or "anywhere"
        node = doc["node_region"] or "-"
        return f"residency of {doc['tenant_id']}: {regions}{default}; node region {node}"
    floor, ceiling = doc["floor_s"], doc["ceiling_s"]
    return f"retention of {doc['tenant_id']}: floor {floor:g} s, ceiling {ceiling:g} s{default}"


def _audit_text(doc: dict[str, Any]) -> str:
    if "records" in doc and isinstance(doc["records"], list):
        columns = [(key, key) for key in ("seq", "ts_us", "actor", "action", "tenant", "subject", "nbytes")]
        return table_text(doc["records"], columns) if doc["records"] else "no audit records"
    verdict = doc.get("verdict") or ("ok" if doc["ok"] else "broken")
    if verdict == "broken":
        where = ""
        if "first_break_seq" in doc:
            where = f" chain {doc['first_break_chain']!r} seq {doc['first_break_seq']}"
        state = f"BROKEN{where}: {doc['reason']}"
    else:
        state = verdict
    lines = [f"audit {state}; {doc['records']} records, head seq {doc['head_seq']}"]
    store = doc.get("store_chain")
    if store:
        pending = doc.get("store_records_pending", 0)
        lines.append(f"store chain {store['chain']}: {'ok' if store.get('ok') else 'BROKEN'}, "
                     f"{store.get('records', 0)} records, {pending} pending delivery")
    if verdict != "unanchored":
        lines.append(f"anchors checked: {doc.get('anchors', 0)}")
    else:
        lines.append("unanchored: no audit_anchor_key_file, so a cut or re-forged chain would pass")
    lines.extend(f"problem: {p}" for p in doc.get("problems", []))
    return "\n".join(lines)


_TEXT: dict[str, Callable[[dict[str, Any]], str]] = {
    "retention": _policy_text,
    "residency": _policy_text,
    "purge": lambda d: (f"purged {d['sessions_deleted']} sessions, {d['segments_deleted']} segments, "
                        f"{d['bytes_deleted']} bytes"),
    "audit": _audit_text,
    "stats": fields_text,
}


def _remote(build: Callable[[argparse.Namespace], tuple[str, Any]]) -> Callable[[argparse.Namespace], int]:
    """Wrap a request builder: call Admin.<method>, print the answer (text or JSON)."""

    def run(args: argparse.Namespace) -> int:
        from kvresume import message_json

        method, request = build(args)
        with connect(args) as client:
            doc = json.loads(message_json(client.call("admin", method, request)))
        if doc.get("warning"):
            print(f"kvresume admin {args.admin_command}: warning: {doc['warning']}", file=sys.stderr)
        print(_TEXT[args.admin_command](doc), file=text_stream(args.json))
        write_json(doc, args.json)
        return 0 if doc.get("ok", True) else 1

    return run


def _add_remote(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=f"{help_text} (client)")
    add_connection_flags(p, role=ADMIN)
    add_json_flag(p, what="the response")
    return p


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "admin", help="policies, purge, audit, stats (client); registry migrations, calibrate (server)"
    )
    sub = parser.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    for name, help_text in (
        ("migrate", "upgrade the registry schema (server)"),
        ("downgrade", "downgrade the schema (server)"),
    ):
        p = sub.add_parser(name, help=help_text)
        add_settings_flags(p)
        p.add_argument(
            "--revision", default="head" if name == "migrate" else None, required=name == "downgrade"
        )
        add_json_flag(p, what="the revision reached")
        p.set_defaults(handler=_migrate)

    p = _add_remote(sub, "retention", "get or set a tenant's retention floor and ceiling")
    p.add_argument("action", choices=["get", "set"])
    p.add_argument("--tenant", required=True)
    p.add_argument("--floor-s", type=float)
    p.add_argument("--ceiling-s", type=float)
    p.set_defaults(handler=_remote(_retention))

    p = _add_remote(sub, "residency", "get or set the regions where a tenant's KV may be stored")
    p.add_argument("action", choices=["get", "set"])
    p.add_argument("--tenant", required=True)
    p.add_argument("--regions", help="comma-separated region labels ('' : anywhere)")
    p.set_defaults(handler=_remote(_residency))

    p = _add_remote(sub, "purge", "delete a session, a tenant, or a model's stored KV")
    p.add_argument("--session")
    p.add_argument("--tenant", help="purge this tenant (or, with --model, restrict to it)")
    p.add_argument("--model")
    p.set_defaults(handler=_remote(_purge))

    p = _add_remote(sub, "audit", "query or verify the audit chain through the server")
    p.add_argument("action", choices=["verify", "query"])
    p.add_argument("--tenant")
    p.add_argument("--event", help="audit action to filter on (store, purge, policy_change, ...)")
    p.add_argument("--after-seq", type=int, default=0)
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(handler=_remote(_audit))

    p = sub.add_parser(
        "audit-local",
        help="verify the audit chains, the store's chain and the anchors without a server (server)",
    )
    add_settings_flags(p)
    add_json_flag(p, what="the verdict")
    p.set_defaults(handler=_audit_verify_local)

    p = sub.add_parser(
        "calibrate", help="measure per-token costs of a model and store them for the planner (server)"
    )
    add_settings_flags(p)
    p.add_argument("--preset", required=True, help="model preset (for example v41-tiny)")
    p.add_argument("--model-name", help="name the planner knows the model by (default: the preset)")
    p.add_argument(
        "--out", help="cost table JSON (default: settings.calibration_file or data_dir/costs.json)"
    )
    p.add_argument("--sizes", default="32,64,128", help="comma-separated token counts to time")
    p.add_argument("--repeats", type=int, default=3)
    add_json_flag(p, what="the measured costs")
    p.set_defaults(handler=_calibrate)

    p = _add_remote(sub, "stats", "store statistics")
    p.add_argument("--tenant")
    p.set_defaults(handler=_remote(_stats))

    admin_store_cmd.register(sub)
