"""Engine and transactions. SQLite gets WAL, synchronous=FULL, a busy timeout and foreign keys on
every pooled connection, and write transactions that take the write lock up front
(`BEGIN IMMEDIATE`), so concurrent committers queue on the busy timeout instead of failing on a
lock upgrade. PostgreSQL write paths lock the job row (`FOR UPDATE`) themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["make_engine", "Database", "SQLITE_PRAGMAS"]

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
        self._single_reads = engine.execution_options(isolation_level="AUTOCOMMIT")

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._reads() as session:
            yield session

    def connect_for_one_read(self) -> Connection:
        """A connection for a single-statement read: no transaction to begin or roll back."""
        return self._single_reads.connect()

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._writes() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
