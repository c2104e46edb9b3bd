"""quotas and their audit trail

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quotas",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("weight", sa.Integer, nullable=False, server_default="1"),
        sa.Column("max_concurrent_requests", sa.Integer, nullable=False),
        sa.Column("max_tokens_per_minute", sa.Integer, nullable=False),
        sa.Column("max_requests_per_minute", sa.Integer, nullable=True),
        sa.Column("burst_tokens", sa.Integer, nullable=True),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("weight >= 1", name="quotas_weight_positive"),
        sa.CheckConstraint("max_concurrent_requests >= 1", name="quotas_concurrency_positive"),
        sa.CheckConstraint("max_tokens_per_minute >= 1", name="quotas_tpm_positive"),
        sa.CheckConstraint(
            "max_requests_per_minute IS NULL OR max_requests_per_minute >= 1", name="quotas_rpm_positive"
        ),
        sa.CheckConstraint("burst_tokens IS NULL OR burst_tokens >= 1", name="quotas_burst_positive"),
    )
    op.create_table(
        "quota_changes",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("changed_by", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("old_value", JSONB, nullable=True),
        sa.Column("new_value", JSONB, nullable=True),
    )
    op.create_index("quota_changes_model_time", "quota_changes", ["model", "changed_at"])


def downgrade() -> None:
    op.drop_table("quota_changes")
    op.drop_table("quotas")
