"""ckptstore metadata service (FastAPI + SQLAlchemy): see docs/rest.md."""

__all__: list[str] = []
