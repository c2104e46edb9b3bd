"""Every status a task can have, in the order ``status`` lists them (the ``tasks_status_known``
check of the ``tasks`` table). ``cancelled``: taken out of the backlog by an operator
(``balancer tasks cancel``)."""

from __future__ import annotations

TASK_STATUSES = ("pending", "ready", "queued", "running", "solved", "failed", "cancelled")
