"""What runs the demo and the tests, never production: the embedded Redis and
PostgreSQL, a process supervisor, an isolated pipeline runner, the demo and the
simulated Models Backend (``sim``)."""
