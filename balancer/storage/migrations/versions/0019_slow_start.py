"""slow start: a quota's slow_start switch (true, with learn: a new or changed quota's slots open gradually)

Revision ID: 0019
Revises: 0018
"""
import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("slow_start", sa.Boolean(), nullable=False, server_default="true"))


def downgrade() -> None:
    op.drop_column("quotas", "slow_start")
