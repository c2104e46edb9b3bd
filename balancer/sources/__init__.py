"""Sources: where tasks come from, and the team's table.

A *source* is the name every task carries (a JSONL file, the inbox, a router
caller, or a declared source table). Each source has a weight (its share of
the dispatch window) and may have a budget per day. A *source table* is a
table someone else owns: balancer reads its rows past a cursor and writes
each ended task back to its own row.

- ``definition``: the sources file (TOML) and :class:`SourceDef` (pure);
- ``rows``: a table's rows to tasks, the cursor's moves (pure);
- ``schema``: balancer's tables for declared sources and their outbox;
- ``store``: declared sources, their import (audited) and cursors;
- ``catalog``: the SQL balancer runs on the team's table (checks at import,
  the guarded and fenced write-back of one row), and ``batchwrite``: that
  write-back for a batch in one statement; ``window``: a poll's read, one
  window of rows in the source's order (its cost the rows it examines);
- ``ingest``: rows past the cursor become tasks;
- ``writeback``: ended tasks back to their rows (drained on a thread), each row
  alone; ``outbox``: the write-backs' states (waiting, conflict, changed,
  unwritable...) and the command's retry and drop; ``reask``: a row changed
  since it was read, or re-opened, asked again;
- ``weights`` and ``budgets``: every source's share and budget per day (audited);
- ``reads`` and ``metrics``: per-source status, for ``status``, the console and
  the metrics.
"""
