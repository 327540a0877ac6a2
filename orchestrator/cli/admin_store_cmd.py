"""`kvresume admin store check|repair`: this node's store, offline (server install).

`check` opens the store read-only (it works beside a running node and changes nothing): every block
read, every entry of the store's own decoded, the store's audit chain verified, quarantined copies
listed; it exits 1 when the store is damaged, of a newer format, or its chain is broken. `repair` does
what `serve` does at start on a damaged store (move it aside, start empty, audit record) and then
removes the quarantined copies (unless `--keep-quarantined`); it refuses while a node holds the store.
Exit codes as every command: 0 done/healthy, 1 failed/unhealthy, 2 usage.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from orchestrator.cli.output import add_json_flag, fields_text, text_stream, write_json
from orchestrator.cli.settings_flags import add_settings_flags, settings_from_args

if TYPE_CHECKING:
    from storage import StoreConfig

__all__ = ["register"]


def _store_config(args: argparse.Namespace) -> StoreConfig:
    from storage import StoreConfig

    settings = settings_from_args(args)
    # The compression ratios only validate chunk_tokens at open; check and repair read no chunk.
    return StoreConfig(
        path=str(settings.data_dir / "kv"),
        region=settings.region,
        chunk_tokens=settings.kv_chunk_tokens,
        compression_ratios=(1,),
        capacity_bytes=settings.kv_capacity_bytes,
    )


def _check(args: argparse.Namespace) -> int:
    from storage import check_store

    cfg = _store_config(args)
    found = check_store(cfg)
    doc = {"path": cfg.path, **found.to_dict()}
    healthy = found.healthy and found.audit_ok is not False
    doc["ok"] = healthy
    summary = {
        "path": cfg.path,
        "status": found.status.value,
        "detail": found.detail,
        "entries": found.entries,
        "chunks": found.chunks,
        "leftovers": found.leftovers,
        "audit": "not read" if found.audit_ok is None else ("ok" if found.audit_ok else found.audit_detail),
        "quarantined": ", ".join(f"{q.name} ({q.reason}, {q.nbytes} B)" for q in found.quarantined) or "none",
    }
    print(fields_text(summary), file=text_stream(args.json))
    write_json(doc, args.json)
    return 0 if healthy else 1


def _repair(args: argparse.Namespace) -> int:
    from storage import repair_store

    cfg = _store_config(args)
    done = repair_store(cfg, keep_quarantined=args.keep_quarantined, actor=args.actor)
    doc = {"path": cfg.path, "ok": True, **done.to_dict()}
    moved = done.quarantined
    summary = {
        "path": cfg.path,
        "quarantined_now": f"{moved.name} ({moved.detail})" if moved is not None else "none (it reads whole)",
        "removed": ", ".join(f"{q.name} ({q.nbytes} B)" for q in done.removed) or "none",
        "chunks": done.chunks,
    }
    print(fields_text(summary), file=text_stream(args.json))
    write_json(doc, args.json)
    return 0


def register(admin_sub: argparse._SubParsersAction) -> None:
    """Add `store` under `kvresume admin`."""
    parser = admin_sub.add_parser("store", help="check or repair this node's KV store offline (server)")
    sub = parser.add_subparsers(dest="store_command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="read the store whole without changing it; exit 1 when damaged")
    add_settings_flags(p)
    add_json_flag(p, what="the findings")
    p.set_defaults(handler=_check)

    p = sub.add_parser(
        "repair", help="quarantine a damaged store and start it empty, then remove quarantined copies"
    )
    add_settings_flags(p)
    p.add_argument("--keep-quarantined", action="store_true", help="keep the quarantined copies on disk")
    p.add_argument("--actor", default="admin:cli", help="who repairs, for the audit record")
    add_json_flag(p, what="what was done")
    p.set_defaults(handler=_repair)
