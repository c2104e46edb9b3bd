"""What runs the demo, the benchmarks and the tests, never production: the embedded Redis
and PostgreSQL (``embedded``), an isolated pipeline runner on ``balancer.supervisor``
(``runner``), the demo (``demo``), the simulated Models Backend (``sim``), benchmark
scenarios and a generator of untuned ones (``scenario``, ``scenario_gen``), a TCP proxy
that stalls like a network partition (``tcpproxy``), and the generator of
docs/configuration.md (``settings_doc``)."""
