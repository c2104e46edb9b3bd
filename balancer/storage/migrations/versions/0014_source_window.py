"""index for the fair share across sources: each source's pending tasks, priority then age

Revision ID: 0014
Revises: 0013
"""
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The dispatcher claims each source's head (balancer.backlog.claims.claim_by_source):
    # one skip-scan probe per source with pending work and one range scan of its
    # head, so the claim costs the same for a backlog of a thousand or of a million.
    # Partial, like tasks_pending_order: a task leaves it when it leaves pending.
    op.execute(
        "CREATE INDEX tasks_pending_source ON tasks (source, priority DESC, id) "
        "WHERE status = 'pending'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX tasks_pending_source")
