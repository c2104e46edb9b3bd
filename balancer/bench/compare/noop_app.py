"""A bare Celery app with a no-op task: the ceiling the overhead benchmark compares against.

Same broker, same acks_late / prefetch settings, same thread pool; the task
only counts itself in Redis.
"""

import os

import redis
from celery import Celery

app = Celery("noop", broker=os.environ["NOOP_BROKER_URL"])
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("NOOP_QUEUE", "noop"),
    broker_transport_options={"global_keyprefix": os.environ.get("NOOP_PREFIX", "noop:")},
)
_counter = redis.Redis.from_url(os.environ["NOOP_COUNTER_URL"])


@app.task(name="noop")
def noop(key: str) -> None:
    _counter.incr(key)
