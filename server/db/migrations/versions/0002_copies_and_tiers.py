"""copies on tiers: a record per tier, local roots, durable positions, resume reports

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("local_root", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("durable_epoch", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("checkpoints") as batch_op:
        batch_op.add_column(sa.Column("tier", sa.String(length=16), nullable=False, server_default="durable"))
        batch_op.drop_constraint("uq_checkpoint", type_="unique")
        batch_op.create_unique_constraint(
            "uq_checkpoint_copy", ["job_id", "node", "epoch", "batch_key", "attempt", "tier"]
        )
    with op.batch_alter_table("positions") as batch_op:
        batch_op.add_column(sa.Column("durable", sa.Boolean(), nullable=False, server_default=sa.false()))
    # Every copy recorded before tiers existed is a durable copy: good positions are durable ones.
    op.execute("UPDATE positions SET durable = good")
    op.execute("UPDATE jobs SET durable_epoch = last_good_epoch")
    with op.batch_alter_table("attempts") as batch_op:
        batch_op.add_column(sa.Column("skipped", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("resumed_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch_op:
        batch_op.drop_column("resumed_at")
        batch_op.drop_column("skipped")
    with op.batch_alter_table("positions") as batch_op:
        batch_op.drop_column("durable")
    op.execute("DELETE FROM checkpoints WHERE tier <> 'durable'")
    with op.batch_alter_table("checkpoints") as batch_op:
        batch_op.drop_constraint("uq_checkpoint_copy", type_="unique")
        batch_op.create_unique_constraint("uq_checkpoint", ["job_id", "node", "epoch", "batch_key", "attempt"])
        batch_op.drop_column("tier")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("durable_epoch")
        batch_op.drop_column("local_root")
