"""The periodic ticks' log lines at DEBUG, not INFO.

Celery logs every task it receives and ends (``celery.worker.strategy``,
``celery.app.trace``) and beat every task it sends (``celery.beat``), all at
INFO: with a dispatch tick each second, a dispatcher's and beat's INFO logs were
mostly "Task balancer.dispatch[...] received / succeeded" lines. This filter
lowers the lines about the ticks (:data:`balancer.admission.keys.TICK_TASKS`) to
DEBUG, so ``--loglevel DEBUG`` still shows them; every other line is untouched.
"""

from __future__ import annotations

import logging
import re

from balancer.admission import keys

#: The loggers Celery writes a task's receipt, end and sending to.
CELERY_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")

_TICK = re.compile(r"(?:^|[\s(])(?:" + "|".join(re.escape(t) for t in keys.TICK_TASKS) + r")(?:\[|\))")


class TicksAtDebug(logging.Filter):
    """An INFO record naming a tick task becomes DEBUG, and passes only where DEBUG is on.

    >>> log = logging.getLogger("ticklog-doctest"); log.setLevel(logging.INFO)
    >>> record = log.makeRecord(log.name, logging.INFO, "f", 1, "Task balancer.dispatch[ab12] received", (), None)
    >>> TicksAtDebug().filter(record), record.levelname
    (False, 'DEBUG')
    >>> other = log.makeRecord(log.name, logging.INFO, "f", 1, "Task balancer.solve[cd34] received", (), None)
    >>> TicksAtDebug().filter(other), other.levelname
    (True, 'INFO')
    >>> log.setLevel(logging.DEBUG)
    >>> beat = log.makeRecord(log.name, logging.INFO, "f", 1, "Scheduler: Sending due task sweep (balancer.sweep)", (), None)
    >>> TicksAtDebug().filter(beat)
    True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not _TICK.search(record.getMessage()):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install() -> None:
    """Put the filter on Celery's task loggers (once: a second call adds nothing)."""
    for name in CELERY_TASK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TicksAtDebug) for f in logger.filters):
            logger.addFilter(TicksAtDebug())
