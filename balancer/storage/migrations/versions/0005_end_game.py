"""the end game: a latency prior per quota, and a task's hedge (a second call on another model)

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("expected_latency_s", sa.Float(), nullable=True))
    # The hedge in flight (cleared when the task returns to pending), how many
    # hedges the task has had, and the tokens they were admitted with.
    op.add_column("tasks", sa.Column("hedge_admission_id", sa.Text(), nullable=True))
    op.add_column("tasks", sa.Column("hedge_model", sa.Text(), nullable=True))
    op.add_column("tasks", sa.Column("hedges", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("tasks", sa.Column("hedge_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    for column in ("hedge_tokens", "hedges", "hedge_model", "hedge_admission_id"):
        op.drop_column("tasks", column)
    op.drop_column("quotas", "expected_latency_s")
