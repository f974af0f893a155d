"""The ckptstore metadata service (FastAPI + SQLAlchemy), installed as `ckptstore.server`; see docs/rest.md.

`python -m ckptstore.server` (what `ckptstore serve` runs) migrates the database once and serves.
"""

if __name__ != "ckptstore.server":  # the repository's folder on sys.path: one module, one name
    raise ImportError(f"import ckptstore.server, not {__name__}: the server/ folder installs as ckptstore.server")

__all__: list[str] = []
