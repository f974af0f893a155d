"""where each node's peer blob server answers (issue 49: peer replicas)

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "blob_servers",
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("node", sa.String(128), primary_key=True),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("token", sa.String(128), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("blob_servers")
