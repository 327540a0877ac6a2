"""Alembic environment: the target metadata is orchestrator/db/models.py, the URL our settings' URL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from orchestrator.db.models import metadata
from orchestrator.settings import load_settings

config = context.config


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or load_settings().resolved_database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    section = dict(config.get_section(config.config_ini_section) or {})
    section["sqlalchemy.url"] = _url()
    connectable = engine_from_config(section, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with connectable.connect() as connection:
        # Batch mode lets the same revision alter tables on SQLite (copy-and-move) and PostgreSQL.
        context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
