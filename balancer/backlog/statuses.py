"""Every status a task can have, in the order ``status`` lists them (the ``tasks_status_known``
check of the ``tasks`` table). ``cancelled``: taken out of the backlog by an operator
(``balancer tasks cancel``)."""

from __future__ import annotations

TASK_STATUSES = ("pending", "ready", "queued", "running", "solved", "failed", "cancelled")

#: Taken by the dispatcher, not ended: on a ready list, in the broker, or calling.
IN_FLIGHT = ("ready", "queued", "running")

#: Not finished: pending, or in flight.
UNFINISHED = ("pending", *IN_FLIGHT)


def sql_list(statuses: tuple[str, ...]) -> str:
    """Statuses as an SQL list for ``IN``, for SQL text declared once (every status is a plain word).

    >>> sql_list(IN_FLIGHT)
    "('ready', 'queued', 'running')"
    """
    return "(" + ", ".join(f"'{s}'" for s in statuses) + ")"
