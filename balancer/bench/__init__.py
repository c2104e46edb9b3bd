"""``balancer bench``: scenarios (package data in ``scenarios/``), runners, the
Airflow-pattern baseline and report maths. Imports production and devtools;
nothing imports it but the CLI."""
