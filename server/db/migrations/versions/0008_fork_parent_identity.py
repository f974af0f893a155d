"""a fork names its parent by identity (the parent's row id), not only by name

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("parent_id", sa.BigInteger(), nullable=True))
        jobs.create_index("ix_jobs_parent_id", ["parent_id"])
    op.execute(
        "UPDATE jobs SET parent_id = (SELECT parent.id FROM jobs AS parent WHERE parent.name = jobs.parent_job) "
        "WHERE parent_job IS NOT NULL"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_index("ix_jobs_parent_id")
        jobs.drop_column("parent_id")
