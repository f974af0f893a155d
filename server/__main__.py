"""`python -m ckptstore.server` (what `ckptstore serve` runs): migrate the database once, then start uvicorn.

Flags mirror the CKPTSTORE_* settings and override them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn
from pydantic import ValidationError

from ckptstore.server.db.migrate import DatabaseRefused, migrate
from ckptstore.server.http.protocol import BoundedHttpToolsProtocol
from ckptstore.server.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    """One flag per setting: `--db-url` for CKPTSTORE_DB_URL, and so on."""
    parser = argparse.ArgumentParser(
        prog="ckptstore serve",
        description="Run the ckptstore metadata service. Every flag overrides its CKPTSTORE_* variable.",
    )
    for field, info in Settings.model_fields.items():
        default = "unset" if info.default in (None, "") else info.default
        about = f"{info.description}; " if info.description else ""
        parser.add_argument(
            "--" + field.replace("_", "-"),
            dest=field,
            default=None,
            metavar=field.upper(),
            help=f"{about}overrides CKPTSTORE_{field.upper()} (default: {default})",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for field in Settings.model_fields:
        value = getattr(args, field)
        if value is not None:
            os.environ[f"CKPTSTORE_{field.upper()}"] = str(value)
    try:
        settings = Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        print(f"ckptstore serve: invalid setting {where.upper() or ''}: {first['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s", stream=sys.stderr)
    try:
        migrate(settings.database_url)
    except DatabaseRefused as exc:
        print(f"ckptstore serve: {exc}", file=sys.stderr)
        return 1
    os.environ.setdefault("CKPTSTORE_DB_URL", settings.database_url)
    uvicorn.run(
        "ckptstore.server.app:app_factory",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        backlog=4096,  # a whole 4,096-node job reconnecting at once is queued, not refused (bench/storm.py)
        loop="uvloop",
        http=BoundedHttpToolsProtocol,
        log_level=settings.log_level.lower(),
        access_log=False,
        proxy_headers=True,
        forwarded_allow_ips=settings.trusted_proxies,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
