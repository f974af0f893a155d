"""Alembic environment: runs on the connection `ckptstore.server.db.migrate` hands over (no alembic.ini)."""

from alembic import context

from ckptstore.server.db.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
