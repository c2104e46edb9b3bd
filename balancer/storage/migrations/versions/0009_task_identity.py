"""task identity and source shares: tasks.key and tasks.metadata, unique per
source; source_weights (every source's share, JSONL and inbox ones included)
and source_changes (their audit, as quota_changes is for quotas)

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("key", sa.Text, nullable=True))
    op.add_column("tasks", sa.Column("metadata", JSONB, nullable=True))
    op.create_index("tasks_source_key", "tasks", ["source", "key"], unique=True,
                    postgresql_where=sa.text("key IS NOT NULL"))
    op.create_table(
        "source_weights",
        sa.Column("source", sa.Text, primary_key=True),
        sa.Column("weight", sa.Integer, nullable=False, server_default="1"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("weight >= 1 AND weight <= 1000000", name="source_weights_weight_range"),
    )
    op.create_table(
        "source_changes",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("changed_by", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("old_value", JSONB, nullable=True),
        sa.Column("new_value", JSONB, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("source_changes")
    op.drop_table("source_weights")
    op.drop_index("tasks_source_key", table_name="tasks")
    op.drop_column("tasks", "metadata")
    op.drop_column("tasks", "key")
