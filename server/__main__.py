"""`python -m server` (what `ckptstore serve` runs): migrate the database once, then start uvicorn.

Flags mirror the CKPTSTORE_* settings and override them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from server.migrate import migrate
from server.settings import Settings

FLAGS = {
    "--host": "host",
    "--port": "port",
    "--workers": "workers",
    "--db-url": "db_url",
    "--storage": "storage",
    "--storage-roots": "storage_roots",
    "--trusted-hosts": "trusted_hosts",
    "--log-level": "log_level",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstore serve", description="Run the ckptstore metadata service.")
    for flag, field in FLAGS.items():
        parser.add_argument(flag, dest=field, default=None, help=f"overrides CKPTSTORE_{field.upper()}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for field in FLAGS.values():
        value = getattr(args, field)
        if value is not None:
            os.environ[f"CKPTSTORE_{field.upper()}"] = str(value)
    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s", stream=sys.stderr)
    migrate(settings.database_url)
    os.environ.setdefault("CKPTSTORE_DB_URL", settings.database_url)
    uvicorn.run(
        "server.app:app_factory",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level.lower(),
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
