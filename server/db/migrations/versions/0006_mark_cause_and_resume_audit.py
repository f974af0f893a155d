"""a mark remembers its cause (retention, gc, a finished fit, restore, verify, …); an attempt its resume
audit and what its registration asked (an Idempotency-Key reused with another body is refused)

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as checkpoints:
        checkpoints.add_column(sa.Column("cause", sa.String(length=16), nullable=True))
    with op.batch_alter_table("attempts") as attempts:
        attempts.add_column(sa.Column("audit", sa.JSON(), nullable=True))
        attempts.add_column(sa.Column("request_body", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as attempts:
        attempts.drop_column("request_body")
        attempts.drop_column("audit")
    with op.batch_alter_table("checkpoints") as checkpoints:
        checkpoints.drop_column("cause")
