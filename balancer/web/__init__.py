"""``balancer web``: the web console (extra ``[web]``: Starlette via FastAPI, uvicorn, Jinja2).

Server-rendered pages on the same read paths as ``balancer status`` and
``balancer top`` (:mod:`balancer.views.summary`), the task operations of
``balancer tasks`` (:mod:`balancer.backlog.operations`) and the quota store
of ``balancer quota set`` (:mod:`balancer.quotas.store`). One module per
concept: ``app`` (routes), ``sampler`` (the background sampler and its
15-minute ring buffer), ``charts`` (pure SVG geometry), ``queries`` (the
console's own read-only SQL), ``forms`` (form input to validated values),
``formatting`` (the templates' filters), ``security`` (token, CSRF, headers). Templates and assets are package data.
"""
