"""the write-back's fence and terminal state: ``tasks.source_fingerprint`` (an md5
of the prompt a source task was read with, as UTF-8: a write-back changes the
team's row only while its prompt still hashes to it) and
``source_outbox.refusals`` (how many times the team's table refused the row's
write-back; at ``BALANCER_WRITEBACK_ATTEMPTS`` its state becomes ``unwritable``).
``source_outbox.state`` is now one of waiting | conflict | changed | written |
unwritable | dropped (see balancer.sources.outbox).

Revision ID: 0020
Revises: 0019
"""
import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("source_fingerprint", sa.Text, nullable=True))
    op.add_column("source_outbox", sa.Column("refusals", sa.Integer, nullable=False, server_default="0"))
    # The outbox rows a re-read row checks against (balancer.sources.reask): by task.
    op.create_index("source_outbox_task", "source_outbox", ["task_id"])


def downgrade() -> None:
    op.drop_index("source_outbox_task", table_name="source_outbox")
    op.drop_column("source_outbox", "refusals")
    op.drop_column("tasks", "source_fingerprint")
