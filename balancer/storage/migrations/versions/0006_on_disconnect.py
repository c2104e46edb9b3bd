"""what a provider does with a cancelled call: finish it (the default) or stop

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("on_disconnect", sa.Text(), nullable=False, server_default="finish"))


def downgrade() -> None:
    op.drop_column("quotas", "on_disconnect")
