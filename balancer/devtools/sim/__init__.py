"""The simulated Models Backend (``balancer sim``).

* ``config`` — simulated models: limits, latency distribution, error rate
* ``limiter`` — the provider's rate limiter (pure): what earns a 429
* ``audit`` — an independent check of the call log against the limits (pure)
* ``server`` — the FastAPI app: /single, /batch, /v1/chat/completions, /models, /log
"""
