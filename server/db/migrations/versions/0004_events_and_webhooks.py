"""the event log, webhooks and their deliveries

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("type", sa.String(length=32), nullable=False),
        sa.Column("job", sa.String(length=128), nullable=True),
        sa.Column("node", sa.String(length=128), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=True),
        sa.Column("batch_key", sa.BigInteger(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_events_job", "events", ["job", "id"])
    op.create_table(
        "webhooks",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("job", sa.String(length=128), nullable=True),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("cursor", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "deliveries",
        sa.Column("webhook", sa.String(length=128), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_attempt_at", sa.Float(), nullable=True),
        sa.Column("next_attempt_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["webhook"], ["webhooks.name"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("webhook", "event_id"),
    )


def downgrade() -> None:
    op.drop_table("deliveries")
    op.drop_table("webhooks")
    op.drop_index("ix_events_job", table_name="events")
    op.drop_table("events")
