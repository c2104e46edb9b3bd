"""Admission: which model may take a task now, or how long until one can.

It runs atomically in Redis, in Lua scripts (``lua/``); ``reference/`` is the pure-Python
model with identical semantics: the readable specification, used by the differential
tests and imported by no production code. This package's ``__init__`` imports nothing:
importers name the module (importing the quota value loads no Redis client).

* ``quota`` — one model's quota: the limits the admission core enforces (pure)
* ``core`` — the admission core: Redis I/O around the Lua scripts
* ``values`` — what production code passes to the core and gets back; the bucket units the scripts get
* ``live`` — the live state each model holds in Redis, read without Lua
* ``liveness`` — how long a worker's consumer record lives, and when lapsed records can be believed (pure)
* ``learned`` — limits that learn: the effective limits, the decrease, the clean-window raise, slow start
* ``shown`` — the provider's rate our own call starts show at a 429: the first bucket, the recent window (pure)
* ``window`` — the window cap: at most a quota's TPM tokens admitted in any 60 s
* ``finishes`` — finishes that could not reach Redis, kept in memory and applied once it answers
* ``keys`` — every Redis key name and queue name
* ``fields`` — every field of a model's hash, declared once
"""
