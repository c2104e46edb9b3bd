"""task operations: a cancelled status, and the audit of retries and cancels

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

BEFORE = ("pending", "queued", "running", "solved", "failed")
AFTER = (*BEFORE, "cancelled")


def upgrade() -> None:
    op.drop_constraint("tasks_status_known", "tasks", type_="check")
    op.create_check_constraint("tasks_status_known", "tasks", f"status IN {AFTER}")
    op.create_table(
        "task_operations",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("done_by", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("filter", JSONB(), nullable=False),
        sa.Column("task_ids", ARRAY(sa.BigInteger()), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("task_operations")
    op.execute("UPDATE tasks SET status = 'failed', error = 'cancelled' WHERE status = 'cancelled'")
    op.drop_constraint("tasks_status_known", "tasks", type_="check")
    op.create_check_constraint("tasks_status_known", "tasks", f"status IN {BEFORE}")
