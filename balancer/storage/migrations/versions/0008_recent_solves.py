"""an index on (status, updated_at): the drain ETA reads the last minute's solves

Revision ID: 0008
Revises: 0007
"""
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("tasks_status_updated", "tasks", ["status", "updated_at"])


def downgrade() -> None:
    op.drop_index("tasks_status_updated", table_name="tasks")
