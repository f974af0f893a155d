"""initial schema

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("storage_root", sa.Text(), nullable=False),
        sa.Column("retention", sa.JSON(), nullable=False),
        sa.Column("nodes_version", sa.Integer(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("last_good_epoch", sa.BigInteger(), nullable=True),
        sa.Column("resume_epoch", sa.BigInteger(), nullable=True),
        sa.Column("resume_batch_key", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "attempts",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("number", sa.BigInteger(), nullable=False),
        sa.Column("resumed_epoch", sa.BigInteger(), nullable=True),
        sa.Column("resumed_batch_key", sa.BigInteger(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "node", "number"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("batch_key", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.String(length=32), nullable=False),
        sa.Column("attempt_number", sa.BigInteger(), nullable=False),
        sa.Column("attempt_suffix", sa.String(length=16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("checksums", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "node", "epoch", "batch_key", "attempt", name="uq_checkpoint"),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoint_position", ["job_id", "epoch", "batch_key"], unique=False)

    op.create_table(
        "health",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("cp_accessible", sa.Boolean(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("reported_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "node"),
    )
    op.create_table(
        "node_sets",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "version"),
    )
    op.create_table(
        "positions",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("batch_key", sa.BigInteger(), nullable=False),
        sa.Column("nodes_version", sa.Integer(), nullable=False),
        sa.Column("good", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "epoch", "batch_key"),
    )
    with op.batch_alter_table("positions", schema=None) as batch_op:
        batch_op.create_index("ix_position_good", ["job_id", "good", "epoch", "batch_key"], unique=False)

    op.create_table(
        "stats",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("stats", schema=None) as batch_op:
        batch_op.create_index("ix_stats_job", ["job_id", "action", "node"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("stats", schema=None) as batch_op:
        batch_op.drop_index("ix_stats_job")

    op.drop_table("stats")
    with op.batch_alter_table("positions", schema=None) as batch_op:
        batch_op.drop_index("ix_position_good")

    op.drop_table("positions")
    op.drop_table("node_sets")
    op.drop_table("health")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoint_position")

    op.drop_table("checkpoints")
    op.drop_table("attempts")
    op.drop_table("jobs")
