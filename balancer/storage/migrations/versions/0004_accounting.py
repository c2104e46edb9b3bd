"""token accounting and request burst per quota; the model a retry should avoid

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing quotas become `reserve`: the accounting that never runs ahead of
    # a provider that keeps what it reserved.
    op.add_column("quotas", sa.Column("token_accounting", sa.Text(), nullable=False, server_default="reserve"))
    op.add_column("quotas", sa.Column("burst_requests", sa.Integer(), nullable=True))
    op.create_check_constraint("quotas_token_accounting", "quotas", "token_accounting IN ('reserve', 'settle')")
    op.add_column("tasks", sa.Column("avoid_model", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "avoid_model")
    op.drop_constraint("quotas_token_accounting", "quotas")
    op.drop_column("quotas", "burst_requests")
    op.drop_column("quotas", "token_accounting")
