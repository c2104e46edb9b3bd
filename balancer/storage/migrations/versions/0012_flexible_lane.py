"""the dispatcher's flexible lane: pending tasks any model may take, in window order

Revision ID: 0012
Revises: 0011
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # balancer.backlog.claims: the window reads tasks any model may take from
    # their own index, so tasks pinned to models that cannot take them now
    # (disabled, or full) are never scanned past.
    op.execute(
        "CREATE INDEX tasks_pending_flexible ON tasks (priority DESC, id) "
        "WHERE status = 'pending' AND allowed_models IS NULL"
    )


def downgrade() -> None:
    op.execute("DROP INDEX tasks_pending_flexible")
