"""Persistence in PostgreSQL: schema, migrations, quota and task stores."""
