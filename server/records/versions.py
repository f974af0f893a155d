"""Which version each job's records are at — the key of the cached last-good answers — without a
database round trip per request while nothing changes.

On PostgreSQL every write transaction NOTIFYs which jobs it changed, with their new versions
(server/db/engine.py); each service process LISTENs on a connection of its own and remembers the newest
version it heard per job. A job it has not heard of is read from the database once. While the
listening connection is down, versions are read on every request and what was heard is forgotten
when it comes back (notifications may have been missed meanwhile), so a cached answer is never
served for a version that changed. The notification reaches the other processes within about a
millisecond of the commit on a local network; that is how stale another replica's answer can be.
On SQLite (one host, in-process) the version is read on every request. The same connection hears
which events other processes wrote (server/events/stream.py wakes its streams on it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ckptstore.server.db.engine import CHANNEL, EVENTS_CHANNEL, Database

__all__ = ["VersionWatch"]

log = logging.getLogger("ckptstore.server")
RECONNECT_S = 1.0


class VersionWatch:
    """The current version of each job, heard (PostgreSQL) or read (otherwise)."""

    def __init__(self, db: Database, *, on_events: Callable[[int], None] | None = None):
        self.db = db
        self.on_events = on_events
        self.heard: dict[str, int] = {}
        self.listening = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not db.is_sqlite:
            db.on_versions = self._written
            self._thread = threading.Thread(target=self._listen, name="ckptstore-versions", daemon=True)
            self._thread.start()

    def version(self, job: str) -> int | None:
        """The job's version (None: no such job). Raises one of `db.errors` when the database is away."""
        if self.listening:
            known = self.heard.get(job)
            if known is not None:
                return known if known > 0 else None
        version = self.db.job_version(job)
        if self.listening and version is not None:
            self.heard[job] = max(version, self.heard.get(job, 0))
        return version

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _listen(self) -> None:
        import psycopg

        url = self.db.engine.url.set(drivername="postgresql")
        while not self._stop.is_set():
            try:
                with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    connection.execute(f"LISTEN {EVENTS_CHANNEL}")
                    self.heard.clear()  # anything heard before may have been missed since
                    self.listening = True
                    while not self._stop.is_set():
                        for notice in connection.notifies(timeout=1.0):
                            if notice.channel == EVENTS_CHANNEL:
                                self._events_written(notice.payload)
                            else:
                                self._heard(notice.payload)
            except Exception as exc:  # the connection dropped: read versions until it is back
                log.warning("version notifications unavailable (%s): reading versions per request", type(exc).__name__)
            self.listening = False
            self._stop.wait(RECONNECT_S)

    def _events_written(self, payload: Any) -> None:
        if self.on_events is not None and str(payload).isdigit():
            self.on_events(int(payload))

    def _written(self, versions: dict[str, int]) -> None:
        """This process committed these versions: known before their notification comes back."""
        if self.listening:
            for job, version in versions.items():
                self.heard[job] = 0 if version == 0 else max(version, self.heard.get(job, 0))

    def _heard(self, payload: Any) -> None:
        version, _, job = str(payload).partition(":")
        if version.isdigit():
            number = int(version)
            self.heard[job] = 0 if number == 0 else max(number, self.heard.get(job, 0))
