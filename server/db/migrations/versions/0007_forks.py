"""a job remembers the checkpoint it was forked from (its parent job and position)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("parent_job", sa.String(length=128), nullable=True))
        jobs.add_column(sa.Column("parent_epoch", sa.BigInteger(), nullable=True))
        jobs.add_column(sa.Column("parent_batch_key", sa.BigInteger(), nullable=True))
        jobs.create_index("ix_jobs_parent_job", ["parent_job"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_index("ix_jobs_parent_job")
        jobs.drop_column("parent_batch_key")
        jobs.drop_column("parent_epoch")
        jobs.drop_column("parent_job")
