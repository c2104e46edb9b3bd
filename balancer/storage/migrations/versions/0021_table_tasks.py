"""a table source's own tasks: ``tasks.from_table`` (set only by a source table's
ingest), the write-back trigger queuing only those, and ``sources.relations``
(what each source's table is, resolved at import: one table is one source)

Revision ID: 0021
Revises: 0020
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def _trigger_function(condition: str) -> str:
    """Migration 0013's ``balancer_task_finished``, the outbox row queued under ``condition``."""
    return f"""
CREATE OR REPLACE FUNCTION balancer_task_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.finished_xid := pg_current_xact_id();
    IF {condition} AND EXISTS (SELECT 1 FROM sources WHERE name = NEW.source) THEN
        INSERT INTO source_outbox (task_id, source, outcome) VALUES (NEW.id, NEW.source, NEW.status);
    END IF;
    IF NEW.dedup AND NEW.reused_from IS NULL THEN
        IF NEW.status = 'solved' THEN
            -- its identical tasks waiting on it take its answer (a reused one gives none on: no recursion)
            UPDATE tasks SET status = 'solved', answer = NEW.answer, model = NEW.model, prompt_tokens = 0,
                             completion_tokens = 0, error = NULL, not_before = NULL, solved_at = now(),
                             updated_at = now(), reused_from = NEW.id
            WHERE dedup AND status = 'pending' AND id <> NEW.id AND md5(prompt) = md5(NEW.prompt)
              AND prompt = NEW.prompt AND max_tokens = NEW.max_tokens
              AND allowed_models IS NOT DISTINCT FROM NEW.allowed_models;
        ELSE
            -- it failed: those waiting on it are dispatched after all
            UPDATE tasks SET not_before = NULL
            WHERE dedup AND status = 'pending' AND not_before > now() AND md5(prompt) = md5(NEW.prompt)
              AND prompt = NEW.prompt AND max_tokens = NEW.max_tokens
              AND allowed_models IS NOT DISTINCT FROM NEW.allowed_models;
        END IF;
    END IF;
    RETURN NEW;
END
$$
"""


def upgrade() -> None:
    op.add_column("tasks", sa.Column("from_table", sa.Boolean, nullable=False, server_default=sa.false()))
    # The tasks ingested before this revision: every keyed task under a declared source's name.
    op.execute("UPDATE tasks SET from_table = true WHERE key IS NOT NULL AND source IN (SELECT name FROM sources)")
    op.execute(_trigger_function("NEW.from_table AND NEW.key IS NOT NULL"))
    op.add_column("sources", sa.Column("relations", ARRAY(sa.Text), nullable=True))


def downgrade() -> None:
    op.drop_column("sources", "relations")
    op.execute(_trigger_function("NEW.key IS NOT NULL"))
    op.drop_column("tasks", "from_table")
