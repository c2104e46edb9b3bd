"""call_usage: one row per call sent to the backend (answered or not), the ledger spend reads

Revision ID: 0018
Revises: 0017
"""
import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "call_usage",
        sa.Column("call_id", sa.Text(), primary_key=True),
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("admission_id", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("answered", sa.Boolean(), nullable=False),
        sa.Column("hedge", sa.Boolean(), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("call_usage_task", "call_usage", ["task_id"])  # prune deletes a task's rows with it
    op.create_index("call_usage_ended", "call_usage", ["ended_at"])  # spend since a time
    # History before the ledger: each solved task's answering call, the only one it recorded.
    op.execute(
        "INSERT INTO call_usage (call_id, task_id, source, model, admission_id, prompt_tokens, completion_tokens,"
        " answered, hedge, ended_at)"
        " SELECT 'task-' || id, id, source, model, coalesce(admission_id, ''), coalesce(prompt_tokens, 0),"
        " coalesce(completion_tokens, 0), true, false, coalesce(solved_at, updated_at)"
        " FROM tasks WHERE status = 'solved' AND model IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_table("call_usage")
