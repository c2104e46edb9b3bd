"""Health: why nothing is moving, for each model and each source.

* ``reasons`` — each model's and source's reasons, from a snapshot of facts (pure)
* ``facts`` — the facts behind them, recorded by the calls and read by ``status`` and the console
"""
