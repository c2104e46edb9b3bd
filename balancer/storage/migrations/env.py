"""Alembic environment: uses the engine handed over in ``config.attributes``."""

from alembic import context

from balancer.storage.schema import metadata

engine = context.config.attributes["engine"]
with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
