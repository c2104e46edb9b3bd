"""Quotas: the quota set an operator declares, stored in PostgreSQL and mirrored into Redis.

One model's quota, the value the admission core enforces, is :mod:`balancer.admission.quota`.

* ``file`` — the quota file: a whole quota set as TOML, for ``balancer quota import/export`` (pure)
* ``rows`` — the stored quotas, read without SQLAlchemy (``status`` reads them on its snapshot)
* ``store`` — quotas in PostgreSQL (the source of truth), with their audit, pushed to the admission core
* ``learned_audit`` — the audit's record of learned limits that stood a minute
"""
