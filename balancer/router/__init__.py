"""The router: an HTTP face on the admission core, for callers outside Celery.

An Airflow DAG, an interactive service or a script asks ``POST /schedule``
for a model, calls the Models Backend itself, and reports ``POST /complete``
(seed design, iterations 1 and 2). Its admissions are leases in the same
Redis core as the pipeline's, so both draw from one budget per model.
See :mod:`balancer.router.app` for the endpoints,
:mod:`balancer.router.admissions` for the router's own admission ids and
idempotent ``/schedule``, :mod:`balancer.router.server` for serving with a
read deadline, :mod:`balancer.router.backpressure` for its waits and advice (pure), and :mod:`balancer.client` for the Python client.
"""
