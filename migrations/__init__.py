"""Alembic environment and revisions for the SQL schema owned by orchestrator/db/models.py."""

__all__: list[str] = []
