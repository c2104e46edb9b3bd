"""tasks (the backlog) and ingested inbox files

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

STATUSES = ("pending", "queued", "running", "solved", "failed")


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("source", sa.Text, nullable=False, server_default="submit"),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("allowed_models", ARRAY(sa.Text), nullable=True),
        sa.Column("max_tokens", sa.Integer, nullable=False),
        sa.Column("model", sa.Text, nullable=True),
        sa.Column("admission_id", sa.Text, nullable=True),
        sa.Column("estimated_tokens", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("answer", sa.Text, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("rate_limited", sa.Integer, nullable=False, server_default="0"),
        sa.Column("not_before", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("solved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint(f"status IN {STATUSES}", name="tasks_status_known"),
        sa.CheckConstraint("estimated_tokens >= 1", name="tasks_estimate_positive"),
    )
    # The dispatcher's window: pending tasks by priority, then age.
    op.execute("CREATE INDEX tasks_pending_order ON tasks (priority DESC, id) WHERE status = 'pending'")
    # The reconcile tick: queued/running tasks past their deadline.
    op.execute("CREATE INDEX tasks_in_flight_deadline ON tasks (deadline) WHERE status IN ('queued', 'running')")
    op.create_index("tasks_status", "tasks", ["status"])
    op.create_table(
        "ingested_files",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("sha256", sa.Text, primary_key=True),
        sa.Column("tasks", sa.Integer, nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    op.drop_table("ingested_files")
    op.drop_table("tasks")
