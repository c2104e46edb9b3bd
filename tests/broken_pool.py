"""A Celery pool that fails as the worker starts: a stand-in for any unrecoverable
error (tests/pipeline/test_faults.py checks the process then exits non-zero)."""

from __future__ import annotations

from celery.concurrency.thread import TaskPool


class BrokenPool(TaskPool):
    def on_start(self) -> None:
        raise RuntimeError("this pool cannot start")
