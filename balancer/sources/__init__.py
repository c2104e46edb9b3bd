"""Sources: where tasks come from, and the team's table.

A *source* is the name every task carries (a JSONL file, the inbox, a router
caller, or a declared source table). Each source has a weight (its share of
the dispatch window) and may have a budget per day. A *source table* is a
table someone else owns: balancer reads its rows past a cursor and writes
each ended task back to its own row.

* ``definition`` — the sources file (TOML) and :class:`SourceDef` (pure)
* ``rows`` — a table's rows to tasks, the cursor's moves (pure)
* ``fairshare`` — weighted deficit round robin across sources over the dispatch window (pure)
* ``schema`` — balancer's tables for declared sources and their outbox
* ``store`` — declared sources, their import (audited) and cursors
* ``removal`` — what removing a source does to its tasks and write-backs
* ``tables`` — what a source's table is at import, whatever its spelling
* ``teamdb`` — the team's database: its engine, a connection within the source's time limits
* ``catalog`` — the SQL balancer runs on the team's table: checks at import, the guarded and fenced write-back of one row, the fence
* ``window`` — a poll's read: one window of rows in the source's order (its cost the rows it examines)
* ``batchwrite`` — that write-back for a batch in one statement
* ``inbox`` — the inbox: every ``*.jsonl`` file in ``BALANCER_INBOX`` becomes tasks, once
* ``ingest`` — a table's rows past the cursor become tasks
* ``polling`` — each source table read on a thread of its own, off the dispatch path
* ``read_errors`` — each source table's last failed read, where every process sees it
* ``writeback`` — ended tasks back to their rows, drained on a thread
* ``outbox`` — the write-backs' states, and the command's retry and drop
* ``reask`` — a row changed since it was read, or re-opened, asked again
* ``weights`` — every source's share (weight) of the dispatch window, with its audit
* ``budgets`` — setting a source's budget per day, with its audit
* ``reads`` — per-source status, for ``status``, ``top``, the console and the dispatcher
* ``unanswered`` — the rows holding no answer from balancer, by key and why (``source rows``)
* ``metrics`` — the sources' Prometheus metrics, added to ``balancer metrics``' families
"""
