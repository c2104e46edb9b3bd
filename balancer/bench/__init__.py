"""Benchmarks, never production: ``chaos/`` (the chaos run and its witness), ``compare/``
(``balancer bench SCENARIO``: the pipeline against the Airflow-pattern baseline and the
capacity bound), ``micro/`` (one figure each) and ``scenarios/`` (the bundled scenarios,
package data). Imports production and devtools; nothing imports it but the CLI."""
