"""window cap: a quota's window_cap switch (true: no 60 s window admits above its TPM/RPM)

Revision ID: 0024
Revises: 0022
"""
import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("window_cap", sa.Boolean(), nullable=False, server_default="false"))


def downgrade() -> None:
    op.drop_column("quotas", "window_cap")
