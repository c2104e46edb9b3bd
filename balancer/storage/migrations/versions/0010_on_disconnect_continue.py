"""names with one meaning: the on_disconnect value "finish" is now "continue"
(a provider continues a call whose client went); "finish" is still accepted
as input and read as "continue"

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.text("UPDATE quotas SET on_disconnect = 'continue' WHERE on_disconnect = 'finish'"))
    op.alter_column("quotas", "on_disconnect", server_default="continue")


def downgrade() -> None:
    op.execute(sa.text("UPDATE quotas SET on_disconnect = 'finish' WHERE on_disconnect = 'continue'"))
    op.alter_column("quotas", "on_disconnect", server_default="finish")
