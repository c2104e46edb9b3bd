"""Dispatch: which pending tasks go to which model's queue, round after round.

* ``dispatcher`` — one dispatch run: pending tasks → admission core → ``solve`` messages
* ``served`` — the models a worker consumes, and the work of those nobody consumes given back
* ``fairness`` — the dispatch window filled across sources by weight
* ``shares`` — the fair share's round-robin state in Redis, shared by every dispatcher
* ``budgets`` — the sources over their budget per day, whose tasks the dispatcher leaves pending
* ``endgame`` — finish-time-aware placement of the last tasks and the hedge choice (pure)
* ``placement`` — the end game in a dispatch round: each open model's outlook from the live state
* ``ready`` — how many tasks a busy model keeps ready, and when to stop (pure)
* ``stocking`` — the ready lists' stock, and marking its tasks ``ready``
* ``lost`` — solve messages the broker lost: their tasks back to pending within seconds, not a lease
* ``trigger`` — coalesced "dispatch now" requests (a slot freed with no next call, a ready list ran low)
* ``fallback`` — the dispatcher's own ticks, for when beat is gone
* ``beat_seen`` — when beat last ticked, read without importing Celery
"""
