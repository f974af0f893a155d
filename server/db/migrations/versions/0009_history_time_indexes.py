"""indexes by time for the advice's window over a job's newest records, and for when a position
was first committed (issue 48, ADV-1)

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as attempts:
        attempts.create_index("ix_attempts_started", ["job_id", "started_at"])
    with op.batch_alter_table("checkpoints") as checkpoints:
        checkpoints.drop_index("ix_checkpoint_position")
        checkpoints.create_index("ix_checkpoint_position_time", ["job_id", "epoch", "batch_key", "created_at"])
        checkpoints.create_index("ix_checkpoints_time", ["job_id", "created_at"])
    with op.batch_alter_table("stats") as stats:
        stats.create_index("ix_stats_action_time", ["job_id", "action", "created_at"])
        stats.create_index("ix_stats_time", ["job_id", "created_at"])


def downgrade() -> None:
    with op.batch_alter_table("stats") as stats:
        stats.drop_index("ix_stats_time")
        stats.drop_index("ix_stats_action_time")
    with op.batch_alter_table("checkpoints") as checkpoints:
        checkpoints.drop_index("ix_checkpoints_time")
        checkpoints.drop_index("ix_checkpoint_position_time")
        checkpoints.create_index("ix_checkpoint_position", ["job_id", "epoch", "batch_key"])
    with op.batch_alter_table("attempts") as attempts:
        attempts.drop_index("ix_attempts_started")
