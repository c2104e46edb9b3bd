"""limits that learn: a quota's learn switch (true: 429s and limit headers lower its effective limits)

Revision ID: 0015
Revises: 0014
"""
import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("learn", sa.Boolean(), nullable=False, server_default="true"))


def downgrade() -> None:
    op.drop_column("quotas", "learn")
