"""Engine and transactions. SQLite gets WAL, synchronous=FULL, a busy timeout and foreign keys on
every pooled connection, and write transactions that take the write lock up front
(`BEGIN IMMEDIATE`), so concurrent committers queue on the busy timeout instead of failing on a
lock upgrade. PostgreSQL write paths lock the job row (`FOR UPDATE`) themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from ckptstore.server.db.transaction import state_of
from ckptstore.server.events.log import write_pending

__all__ = ["make_engine", "Database", "SQLITE_PRAGMAS", "CHANNEL", "EVENTS_CHANNEL"]

CHANNEL = "ckptstore_jobs"  # NOTIFY payload: "<version>:<job>" (version 0: the job was deleted)
EVENTS_CHANNEL = "ckptstore_events"  # NOTIFY payload: the newest event id written

_NOTIFY = text(
    "SELECT pg_notify(channel, payload) FROM unnest(CAST(:channels AS text[]), CAST(:payloads AS text[]))"
    " AS notes(channel, payload)"
)
SQLITE_PRAGMAS = {"journal_mode": "wal", "synchronous": 2, "busy_timeout": 30000, "foreign_keys": 1}


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        # No pre-ping (a round trip per checkout on the hot path): SQLAlchemy invalidates the pool
        # on a disconnect error, which the app answers 503 + Retry-After, and clients retry.
        return create_engine(url, pool_size=10, max_overflow=20, pool_recycle=1800)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=16, max_overflow=16)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # transactions are begun below, not by pysqlite
        cursor = dbapi_connection.cursor()
        for name, value in SQLITE_PRAGMAS.items():
            cursor.execute(f"PRAGMA {name}={value}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection) -> None:
        write = connection.get_execution_options().get("ckptstore_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


class Database:
    """Read sessions, and write transactions that commit on success and roll back on any error."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._reads = sessionmaker(engine, expire_on_commit=False)
        self._writes = sessionmaker(engine.execution_options(ckptstore_write=True), expire_on_commit=False)
        marker = "?" if engine.dialect.paramstyle == "qmark" else "%s"
        self.version_sql = f"SELECT version FROM jobs WHERE name = {marker}"
        self._version_connection: Any = None
        self.errors: tuple[type[Exception], ...] = (SQLAlchemyError, engine.dialect.loaded_dbapi.Error)
        self.on_events: Callable[[int], None] | None = None
        self.on_versions: Callable[[dict[str, int]], None] | None = None  # jobs this process changed, committed

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._reads() as session:
            yield session

    def job_version(self, name: str) -> int | None:
        """The job's version counter, read on a dedicated autocommit DBAPI connection.

        The hot path's one database read: no pool checkout, no transaction, a prepared statement.
        Call it from one thread only (the event loop); the connection is reopened once on error,
        then the error (one of `self.errors`) propagates.
        """
        for retry in (False, True):
            try:
                if self._version_connection is None:
                    self._version_connection = self._open_version_connection()
                cursor = self._version_connection.cursor()
                cursor.execute(self.version_sql, (name,))
                row = cursor.fetchone()
                cursor.close()
                return None if row is None else int(row[0])
            except Exception:
                self._close_version_connection()
                if retry:
                    raise
        raise AssertionError("not reached: the second try returns or raises")

    def _open_version_connection(self) -> Any:
        connection = self.engine.raw_connection()
        if not self.is_sqlite:
            connection.driver_connection.autocommit = True  # type: ignore[union-attr]
        return connection

    def _close_version_connection(self) -> None:
        if self._version_connection is not None:
            try:
                self._version_connection.invalidate()
            except Exception:  # already broken; it is dropped either way
                pass
            self._version_connection = None

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A write transaction. It writes the events its changes emitted (server/events/log.py); on
        PostgreSQL it tells every service process (LISTEN, server/records/versions.py) which jobs it changed
        and the newest event id, delivered when it commits; in this process `on_events` hears of new
        events once they are committed, and `on_versions` of the jobs' new versions (so this process
        never answers from a cache older than its own writes while the notification is on its way)."""
        with self._writes() as session:
            with session.begin():
                yield session
                newest_event = write_pending(session, postgres=not self.is_sqlite)
                changed = state_of(session).changed_jobs
                if not self.is_sqlite:
                    self._notify(session, changed, newest_event)
            if changed and self.on_versions is not None:
                self.on_versions({name: 0 if job is None else job.version for name, job in changed.items()})
            if newest_event is not None and self.on_events is not None:
                self.on_events(newest_event)

    @staticmethod
    def _notify(session: Session, changed: dict[str, Any], newest_event: int | None) -> None:
        notes = [(CHANNEL, f"{0 if job is None else job.version}:{name}") for name, job in changed.items()]
        if newest_event is not None:
            notes.append((EVENTS_CHANNEL, str(newest_event)))
        if notes:  # one round trip for a whole batch's jobs
            channels, payloads = zip(*notes, strict=True)
            session.execute(_NOTIFY, {"channels": list(channels), "payloads": list(payloads)})

    def dispose(self) -> None:
        self._close_version_connection()
        self.engine.dispose()
