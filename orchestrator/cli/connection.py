"""How a client command reaches a running server: its address, its token, TLS and the deadline, from
flags, then the environment, then the settings. Uses only the light `kvresume` package (no model stack).

Defaults: the target is `$KVRESUME_TARGET`, else the settings' `grpc_host:grpc_port` (so
`KVRESUME_GRPC_PORT`, or a `--config` file, reaches the server `kvresume serve` started with them). A
tenant call's token is `$KVRESUME_TOKEN`; an admin call's is `$KVRESUME_ADMIN_TOKEN`, else the settings'
`admin_token`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvresume import Client
from orchestrator.cli.settings_flags import add_config_flag, settings_from_args

__all__ = ["TENANT", "ADMIN", "ANY", "add_connection_flags", "connect"]

# Who a command calls as: a tenant, the admin, or either (Models, Mappers reads).
TENANT, ADMIN, ANY = "tenant", "admin", "any"

_TOKEN_HELP = {
    TENANT: "tenant token (default: $KVRESUME_TOKEN)",
    ADMIN: "admin token (default: $KVRESUME_ADMIN_TOKEN, else the settings' admin_token)",
    ANY: "a tenant or the admin token (default: $KVRESUME_TOKEN, else $KVRESUME_ADMIN_TOKEN)",
}


def add_connection_flags(parser: argparse.ArgumentParser, *, role: str, timeout_s: float = 30.0) -> None:
    add_config_flag(parser)
    parser.add_argument(
        "--target", help="server host:port (default: $KVRESUME_TARGET, else the settings' grpc address)"
    )
    parser.add_argument("--token", help=_TOKEN_HELP[role])
    parser.add_argument("--tls-ca", help="CA bundle for a TLS server")
    parser.add_argument("--timeout", type=float, default=timeout_s, help="RPC deadline in seconds")
    parser.set_defaults(role=role)


def _token(args: argparse.Namespace) -> str:
    if args.token:
        return args.token
    env = os.environ
    if args.role == TENANT:
        return env.get("KVRESUME_TOKEN", "")
    if args.role == ANY:
        return env.get("KVRESUME_TOKEN", "") or env.get("KVRESUME_ADMIN_TOKEN", "")
    return env.get("KVRESUME_ADMIN_TOKEN", "") or settings_from_args(args).admin_token


def connect(args: argparse.Namespace) -> Client:
    """A client for the command's target, with its token bound.

    Raises:
        ValueError: no token (naming the flag and the variable), or invalid settings.
    """
    target = args.target or os.environ.get("KVRESUME_TARGET", "")
    if not target:
        target = settings_from_args(args).grpc_address
    token = _token(args)
    if not token:
        variable = "KVRESUME_ADMIN_TOKEN" if args.role == ADMIN else "KVRESUME_TOKEN"
        raise ValueError(f"no {args.role} token: pass --token or set {variable}")
    ca = Path(args.tls_ca) if args.tls_ca else None
    return Client(target, token=token, tls_ca_file=ca, timeout_s=args.timeout)
