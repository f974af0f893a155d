"""A real uvicorn serving `create_app(settings)` on 127.0.0.1 in a background thread (httpx's pattern),
with the service's own HTTP protocol."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import httpx
import uvicorn

from ckptstore.server.app import create_app
from ckptstore.server.db.migrate import migrate
from ckptstore.server.http.protocol import BoundedHttpToolsProtocol
from ckptstore.server.settings import Settings
from tests.servers import free_port

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def wait_for(condition, *, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    """Poll until `condition()` is truthy; fail after `timeout` seconds (no sleeping as synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


class LiveService:
    """The service on a free loopback port; `.client()` gives an httpx client bound to it."""

    def __init__(self, settings: Settings, *, port: int | None = None):
        self.settings = settings
        migrate(settings.database_url)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            http=BoundedHttpToolsProtocol,  # the service's own protocol, as `ckptstore serve` runs it
            log_level="warning",
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn start")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_service_process(
    tmp_path, port: int, workers: int = 1, db_url: str | None = None, **settings: str
) -> subprocess.Popen:
    """`python -m ckptstore.server` in its own process (so it can be SIGKILLed), ready to serve on `port`;
    `settings` are further CKPTSTORE_* values (`trusted_proxies="10.0.0.1"`)."""
    env = (
        os.environ
        | {f"CKPTSTORE_{name.upper()}": value for name, value in settings.items()}
        | {
            "CKPTSTORE_DB_URL": db_url or f"sqlite:///{tmp_path}/kill.db",
            "CKPTSTORE_PORT": str(port),
            "CKPTSTORE_STORAGE": f"{tmp_path}/storage",
            "CKPTSTORE_LOG_LEVEL": "warning",
            "CKPTSTORE_WORKERS": str(workers),
        }
    )
    process = subprocess.Popen([sys.executable, "-m", "ckptstore.server"], env=env)

    def ready():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return process.poll() is not None

    wait_for(ready, timeout=30, what="service start")
    assert process.poll() is None, "the service exited during start"
    return process


def postgres_available() -> bool:
    """Start the machine's PostgreSQL cluster if it is installed but stopped (FACTS.md)."""
    if subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", "5432"], capture_output=True).returncode == 0:
        return True
    if shutil.which("pg_ctlcluster") is None:
        return False
    versions = subprocess.run(["ls", "/etc/postgresql"], capture_output=True, text=True).stdout.split()
    for version in versions:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"], capture_output=True)
    try:
        wait_for(
            lambda: subprocess.run(["pg_isready", "-h", "127.0.0.1"], capture_output=True).returncode == 0,
            timeout=30,
            interval=0.2,
            what="PostgreSQL",
        )
    except TimeoutError:
        return False
    return True


class ScratchPostgres:
    """A fresh PostgreSQL database for one test session, dropped afterwards."""

    def __init__(self) -> None:
        from sqlalchemy import create_engine, text

        self.name = f"ckptstore_test_{uuid.uuid4().hex[:12]}"
        self._admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with self._admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{self.name}"'))
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.name}"

    def drop(self) -> None:
        from sqlalchemy import text

        with self._admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self._admin.dispose()


class PrivatePostgres:
    """A PostgreSQL cluster of its own (initdb in a temporary directory, its own port), so a test can
    crash and restart it without disturbing the machine's server. Needs root (initdb runs as the
    postgres user, FACTS.md) and the server binaries."""

    def __init__(self) -> None:
        import glob
        import tempfile

        binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
        if os.geteuid() != 0 or not binaries:
            raise RuntimeError("a private PostgreSQL cluster needs root and /usr/lib/postgresql/*/bin")
        self.bin, self.port = binaries[-1], free_port()
        self.dir = tempfile.mkdtemp(prefix="ckptstore-pg-")
        shutil.chown(self.dir, "postgres", "postgres")
        self._as_postgres("initdb", "-D", f"{self.dir}/data", "-U", "postgres", "-A", "trust", "--no-sync")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.start()

    def _as_postgres(self, program: str, *args: str, check: bool = True) -> None:
        command = ["runuser", "-u", "postgres", "--", f"{self.bin}/{program}", *args]
        subprocess.run(command, check=check, capture_output=True, cwd=self.dir)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._as_postgres("pg_ctl", "-D", f"{self.dir}/data", "-o", options, "-l", f"{self.dir}/log", "-w", "start")

    def crash(self) -> None:
        """Stop as a power cut would: immediate mode, no checkpoint; recovery replays the WAL."""
        self._as_postgres("pg_ctl", "-D", f"{self.dir}/data", "-m", "immediate", "-w", "stop")

    def destroy(self) -> None:
        self._as_postgres("pg_ctl", "-D", f"{self.dir}/data", "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
