"""source_budgets: a source's budget per day, in money (the quotas' currency) or tokens

Revision ID: 0017
Revises: 0016
"""
import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "source_budgets",
        sa.Column("source", sa.Text, primary_key=True),
        sa.Column("money_per_day", sa.Float, nullable=True),
        sa.Column("tokens_per_day", sa.BigInteger, nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("money_per_day >= 0 AND tokens_per_day >= 0", name="source_budgets_not_negative"),
    )


def downgrade() -> None:
    op.drop_table("source_budgets")
