"""ckptstore metadata service (FastAPI + SQLAlchemy): see docs/rest.md."""
