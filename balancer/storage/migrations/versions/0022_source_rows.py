"""rows of a source table that are not tasks, and a retried task's row: ``source_rejects``
(each row of a source table that could not be a task, by key, with its reason: the cursor
moves past a row only once it is recorded here), ``sources.null_keys`` (rows matching
``where`` whose key is NULL, as last counted) and ``tasks.source_replaces`` (what a
source task's failure wrote to its row before ``tasks retry``: its next write-back may
replace exactly that).

Revision ID: 0022
Revises: 0021
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "source_rejects",
        sa.Column("source", sa.Text, primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.add_column("sources", sa.Column("null_keys", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("tasks", sa.Column("source_replaces", JSONB, nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "source_replaces")
    op.drop_column("sources", "null_keys")
    op.drop_table("source_rejects")
