"""Schema migrations (Alembic), run once before the workers start — under an advisory lock on
PostgreSQL, so several service instances starting together migrate exactly once."""

from __future__ import annotations

import os

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import DatabaseError

from ckptstore.server.db.engine import make_engine

__all__ = ["migrate", "alembic_config", "DatabaseRefused"]

_ADVISORY_LOCK = 0x636B7074  # "ckpt"
HEAD_REVISION = "0010"  # the newest file in migrations/versions; a test checks they agree


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", os.path.join(os.path.dirname(__file__), "migrations"))
    return config


class DatabaseRefused(Exception):
    """The database cannot be used as it is; the message says what to do (one line)."""


def _known_revisions() -> set[str]:
    versions = os.path.join(os.path.dirname(__file__), "migrations", "versions")
    return {name[:4] for name in os.listdir(versions) if name[:4].isdigit()}


def _current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as connection:
            if not inspect(connection).has_table("alembic_version"):
                return None  # a new database
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DatabaseError as exc:
        raise DatabaseRefused(
            f"the database at {engine.url.render_as_string(hide_password=True)} cannot be read "
            f"({type(exc.orig).__name__}: {str(exc.orig).splitlines()[0] if exc.orig else exc}): "
            "restore it from a backup (docs/operations.md) or point CKPTSTORE_DB_URL at another one"
        ) from None


def migrate(url: str, *, engine: Engine | None = None) -> None:
    """Bring the database at `url` to the newest schema (a no-op, without loading Alembic's
    migration scripts, when it is already there). An engine made here is disposed of before
    returning: its connections close now, not whenever the garbage collector gets to them (on
    SQLite the last close is what checkpoints the migration's write-ahead log)."""
    if engine is not None:
        _upgrade(engine)
        return
    engine = make_engine(url)
    try:
        _upgrade(engine)
    finally:
        engine.dispose()


def _upgrade(engine: Engine) -> None:
    current = _current_revision(engine)
    if current == HEAD_REVISION:
        return
    if current is not None and current not in _known_revisions():
        raise DatabaseRefused(
            f"the database is at schema revision {current}, newer than this ckptstore knows ({HEAD_REVISION}): "
            "upgrade ckptstore, or restore a backup taken before the upgrade"
        )
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
