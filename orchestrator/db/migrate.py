"""Run the Alembic revisions in migrations/ against a database URL (the only way the schema changes).

Knows nothing of the revisions' contents; `migrations/alembic.ini` works from the CLI as well:
`alembic -c migrations/alembic.ini upgrade head` (URL from the settings object).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

__all__ = ["alembic_config", "upgrade", "downgrade", "ALEMBIC_INI"]

ALEMBIC_INI = Path(__file__).resolve().parents[2] / "migrations" / "alembic.ini"


def alembic_config(url: str) -> Config:
    """An Alembic Config over migrations/ that targets `url` instead of the settings' URL."""
    if not ALEMBIC_INI.is_file():
        raise FileNotFoundError(f"alembic.ini not found at {ALEMBIC_INI}")
    config = Config(str(ALEMBIC_INI))
    # ConfigParser interpolation would read a '%' in a password as a placeholder.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision`."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at `url` down to `revision` (`base` drops every table)."""
    command.downgrade(alembic_config(url), revision)
