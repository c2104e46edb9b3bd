"""task status ready: a task waiting on its model's ready list (queued: its solve message was published)

Revision ID: 0016
Revises: 0015
"""
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

BEFORE = ("pending", "queued", "running", "solved", "failed", "cancelled")
AFTER = ("pending", "ready", "queued", "running", "solved", "failed", "cancelled")


def upgrade() -> None:
    op.drop_constraint("tasks_status_known", "tasks", type_="check")
    op.create_check_constraint("tasks_status_known", "tasks", f"status IN {AFTER}")
    # The sweep and the overdue count read ready entries' deadlines too.
    op.execute("DROP INDEX tasks_in_flight_deadline")
    op.execute("CREATE INDEX tasks_in_flight_deadline ON tasks (deadline) WHERE status IN ('ready', 'queued', 'running')")
    # Ready-list entries were queued under an ``r...`` admission id.
    op.execute("UPDATE tasks SET status = 'ready' WHERE status = 'queued' AND admission_id LIKE 'r%'")


def downgrade() -> None:
    op.execute("UPDATE tasks SET status = 'queued' WHERE status = 'ready'")
    op.execute("DROP INDEX tasks_in_flight_deadline")
    op.execute("CREATE INDEX tasks_in_flight_deadline ON tasks (deadline) WHERE status IN ('queued', 'running')")
    op.drop_constraint("tasks_status_known", "tasks", type_="check")
    op.create_check_constraint("tasks_status_known", "tasks", f"status IN {BEFORE}")
