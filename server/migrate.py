"""Schema migrations (Alembic), run once before the workers start — under an advisory lock on
PostgreSQL, so several service instances starting together migrate exactly once."""

from __future__ import annotations

import os

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

from server.db import make_engine

__all__ = ["migrate", "alembic_config"]

_ADVISORY_LOCK = 0x636B7074  # "ckpt"
HEAD_REVISION = "0001"  # the newest file in migrations/versions; a test checks they agree


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", os.path.join(os.path.dirname(__file__), "migrations"))
    return config


def _current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception:  # no table yet: a new database
        return None


def migrate(url: str, *, engine: Engine | None = None) -> None:
    """Bring the database at `url` to the newest schema (a no-op, without loading Alembic's
    migration scripts, when it is already there)."""
    engine = engine or make_engine(url)
    if _current_revision(engine) == HEAD_REVISION:
        return
    config = alembic_config()
    with engine.connect() as connection:
        postgres = connection.dialect.name == "postgresql"
        if postgres:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _ADVISORY_LOCK})
            connection.commit()
        try:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()
        finally:
            if postgres:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _ADVISORY_LOCK})
                connection.commit()
