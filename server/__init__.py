"""ckptstore metadata service (FastAPI + SQLAlchemy): see DESIGN.md "Service API"."""
