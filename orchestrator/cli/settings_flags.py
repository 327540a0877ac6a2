"""The settings flags of the commands that read the service's settings (`--config`, `--data-dir`,
`--database-url`), and the Settings they give. Light: imports only orchestrator.settings."""

from __future__ import annotations

import argparse

from orchestrator.settings import Settings, load_settings

__all__ = ["add_config_flag", "add_settings_flags", "settings_from_args"]


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="settings TOML (default: $KVRESUME_CONFIG)")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    add_config_flag(parser)
    parser.add_argument("--database-url", help="SQLAlchemy URL of the registry (default: SQLite in data dir)")
    parser.add_argument("--data-dir", help="data directory")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from --config / environment / the flags shared by the service commands.

    Raises:
        ValueError: an unknown or invalid setting.
        OSError: the TOML file cannot be read.
    """
    return load_settings(
        toml_path=getattr(args, "config", None),
        overrides={
            "database_url": getattr(args, "database_url", None),
            "data_dir": getattr(args, "data_dir", None),
            "grpc_host": getattr(args, "host", None),
            "grpc_port": getattr(args, "port", None),
            "metrics_port": getattr(args, "metrics_port", None),
            "http_port": getattr(args, "http_port", None),
            "region": getattr(args, "region", None),
            "served_models": getattr(args, "models", None),
            "model_numerics": getattr(args, "numerics", None),
        },
    )
