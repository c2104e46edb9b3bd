"""prices per model and their currency; indexes for task search by status or source, newest first

Prices: per million input and output tokens, in one currency (balancer.costs.cost).
Search: ``balancer tasks list`` and the web console list tasks by status or by
source, newest first, with a limit. ``(status, id)`` replaces ``(status)`` (it
serves every lookup that one did, so the tasks' status changes maintain no
more indexes than before) and ``(source, id)`` is new.

Revision ID: 0011
Revises: 0010
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("price_per_million_input", sa.Float, nullable=True))
    op.add_column("quotas", sa.Column("price_per_million_output", sa.Float, nullable=True))
    op.add_column("quotas", sa.Column("currency", sa.Text, nullable=True))
    op.create_index("tasks_status_id", "tasks", ["status", "id"])
    op.drop_index("tasks_status", table_name="tasks")
    op.create_index("tasks_source_id", "tasks", ["source", "id"])


def downgrade() -> None:
    op.drop_index("tasks_source_id", table_name="tasks")
    op.create_index("tasks_status", "tasks", ["status"])
    op.drop_index("tasks_status_id", table_name="tasks")
    op.drop_column("quotas", "currency")
    op.drop_column("quotas", "price_per_million_output")
    op.drop_column("quotas", "price_per_million_input")
