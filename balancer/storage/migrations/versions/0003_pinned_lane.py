"""index for the dispatcher's pinned lane: pending tasks pinned to one model

Revision ID: 0003
Revises: 0002
"""
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # claim_pinned: "pending tasks whose allowed_models = {m}, by priority then
    # age" is one index range scan per model, at any backlog size.
    op.execute(
        "CREATE INDEX tasks_pending_pinned ON tasks (allowed_models, priority DESC, id) "
        "WHERE status = 'pending' AND allowed_models IS NOT NULL"
    )


def downgrade() -> None:
    op.execute("DROP INDEX tasks_pending_pinned")
