"""prices per million input and output tokens per model, and their currency

Revision ID: 0011
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quotas", sa.Column("price_per_million_input", sa.Float, nullable=True))
    op.add_column("quotas", sa.Column("price_per_million_output", sa.Float, nullable=True))
    op.add_column("quotas", sa.Column("currency", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("quotas", "currency")
    op.drop_column("quotas", "price_per_million_output")
    op.drop_column("quotas", "price_per_million_input")
