"""source tables: ``sources`` (each declared source, its read cursor), the
write-back outbox ``source_outbox`` filled by a trigger on ``tasks`` in the
same transaction as a task's end, ``tasks.finished_xid`` (the transaction
that ended a task: the results export's cursor), the ``balancer_results``
view, and answer reuse: ``tasks.dedup`` (the task may take, and give, the
answer of an identical task) and ``tasks.reused_from`` (the task whose answer
it took)

Revision ID: 0013
Revises: 0012
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# BEFORE, so that the row the UPDATE writes carries its finishing transaction;
# the outbox row is inserted by the same statement, in the same transaction as
# the status change: committed together or not at all.
TRIGGER_FUNCTION = """
CREATE FUNCTION balancer_task_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.finished_xid := pg_current_xact_id();
    IF NEW.key IS NOT NULL AND EXISTS (SELECT 1 FROM sources WHERE name = NEW.source) THEN
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

TRIGGER = """
CREATE TRIGGER tasks_finished BEFORE UPDATE OF status ON tasks FOR EACH ROW
WHEN (NEW.status IN ('solved', 'failed') AND OLD.status IS DISTINCT FROM NEW.status)
EXECUTE FUNCTION balancer_task_finished()
"""

RESULTS_VIEW = """
CREATE VIEW balancer_results AS
SELECT id, source, key, metadata, status, answer, error, model, prompt_tokens, completion_tokens,
       created_at, started_at, solved_at, updated_at, finished_xid
FROM tasks
WHERE status IN ('solved', 'failed') AND finished_xid IS NOT NULL
"""


def upgrade() -> None:
    op.create_table(
        "sources",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("definition", JSONB, nullable=False),
        sa.Column("position", JSONB, nullable=True),  # the largest key read (the ingest cursor)
        sa.Column("rescan", JSONB, nullable=True),  # how far the rescan behind the cursor has come
        sa.Column("ingested", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("read_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("caught_up_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "source_outbox",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.BigInteger, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),  # solved | failed
        sa.Column("state", sa.Text, nullable=False, server_default="waiting"),  # waiting | conflict
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("source_outbox_waiting", "source_outbox", ["source", "id"],
                    postgresql_where=sa.text("state = 'waiting'"))
    op.execute("ALTER TABLE tasks ADD COLUMN finished_xid xid8")
    op.add_column("tasks", sa.Column("dedup", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("tasks", sa.Column("reused_from", sa.BigInteger, nullable=True))
    op.execute("CREATE INDEX tasks_dedup ON tasks (md5(prompt), max_tokens) WHERE dedup")
    # `status` and the metrics count reused tasks on every read: from this index, not the table.
    op.execute("CREATE INDEX tasks_reused ON tasks (id) WHERE reused_from IS NOT NULL")
    op.execute("UPDATE tasks SET finished_xid = pg_current_xact_id() WHERE status IN ('solved', 'failed')")
    op.execute("CREATE INDEX tasks_finished ON tasks (finished_xid, id) WHERE finished_xid IS NOT NULL")
    op.execute(TRIGGER_FUNCTION)
    op.execute(TRIGGER)
    op.execute(RESULTS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW balancer_results")
    op.execute("DROP TRIGGER tasks_finished ON tasks")
    op.execute("DROP FUNCTION balancer_task_finished()")
    op.execute("DROP INDEX tasks_finished")
    op.execute("DROP INDEX tasks_reused")
    op.execute("DROP INDEX tasks_dedup")
    op.drop_column("tasks", "reused_from")
    op.drop_column("tasks", "dedup")
    op.execute("ALTER TABLE tasks DROP COLUMN finished_xid")
    op.drop_index("source_outbox_waiting", table_name="source_outbox")
    op.drop_table("source_outbox")
    op.drop_table("sources")
