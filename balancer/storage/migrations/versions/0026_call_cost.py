"""call cost: each ledger row keeps what its call cost at the prices in force when it was made

Rows written before this revision are priced once here, at the prices their
models have now (the best that is known of them); later calls are priced by
the worker when each starts (balancer.calls.call).

Revision ID: 0026
Revises: 0024
"""
import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("call_usage", sa.Column("cost", sa.Float(), nullable=True))
    op.add_column("call_usage", sa.Column("currency", sa.Text(), nullable=True))
    op.execute(
        "UPDATE call_usage u SET currency = q.currency, "
        "cost = (u.prompt_tokens * coalesce(q.price_per_million_input, 0) "
        "        + u.completion_tokens * coalesce(q.price_per_million_output, 0)) / 1000000.0 "
        "FROM quotas q WHERE q.name = u.model "
        "AND (q.price_per_million_input IS NOT NULL OR q.price_per_million_output IS NOT NULL)"
    )


def downgrade() -> None:
    op.drop_column("call_usage", "currency")
    op.drop_column("call_usage", "cost")
