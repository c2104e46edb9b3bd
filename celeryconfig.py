"""Celery configuration for balancer, driven by BALANCER_* environment variables.

Installed as a top-level module too, so ``celery -A balancer.pipeline.app``
finds it from any directory. Importing it has no side effects: it reads the
environment and nothing else. It never starts the embedded stack or opens a
connection; the ``balancer`` commands that need services resolve them first and
export the URLs (see ``balancer.cli.resolved_settings``). Why each setting:

* acks_late + prefetch 1 + reject_on_worker_lost: a message is acknowledged
  only after its answer is in PostgreSQL; a worker that dies mid-call leaves
  it to be redelivered after the broker's visibility timeout. No hand-made leases
  for messages (the admission core's leases are for *quota*, not delivery).
* hard time limit < visibility timeout: a long call is never redelivered
  while it still runs (see Settings.check_timing). Its quota slot and its
  task's deadline are short leases a heartbeat renews while it runs
  (balancer.calls.heartbeat), and a redelivered copy of a message whose
  call is still running starts no second call.
* No result backend: results go to PostgreSQL.
* JSON only. No ETA/countdown longer than a dispatch tick (well under the
  visibility timeout; see balancer.dispatch.trigger).

>>> conf = from_settings(Settings(redis_url="redis://h:6379/0", database_url=None, broker_url=None))
>>> conf["broker_url"], conf["task_acks_late"], conf["broker_transport_options"]["global_keyprefix"]
('redis://h:6379/0', True, 'balancer:')

A Redis behind Sentinel (the broker follows the admission Redis unless it is set apart):

>>> conf = from_settings(Settings(redis_url="sentinel://:pw@s1,s2:26380/mymaster/3", database_url=None, broker_url=None))
>>> conf["broker_url"], conf["broker_transport_options"]["master_name"]
('sentinel://:pw@s1:26379/3;sentinel://:pw@s2:26380/3', 'mymaster')
"""

from __future__ import annotations

from typing import Any

from balancer.admission import keys
from balancer.settings import Settings
from balancer.urls import is_sentinel_url, parse_sentinel_url


def from_settings(settings: Settings) -> dict[str, Any]:
    """Every Celery setting, derived from one :class:`Settings` snapshot."""
    settings.check_timing()
    broker_url = settings.broker_url or settings.redis_url
    transport: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout}
    if broker_url and is_sentinel_url(broker_url):
        # One URL naming every Sentinel and the master (balancer.urls.SENTINEL_FORM), as
        # kombu's sentinel transport takes it: a URL per Sentinel and the master's name
        # apart. Its pool asks the Sentinels for the master on every reconnection, so
        # a failover is followed without a restart.
        target = parse_sentinel_url(broker_url, "BALANCER_BROKER_URL" if settings.broker_url else "BALANCER_REDIS_URL")
        broker_url = target.broker_urls()
        transport.update(master_name=target.master,
                         sentinel_kwargs={"socket_connect_timeout": 1, "socket_timeout": 1})
    if broker_url and broker_url.lower().startswith(("redis://", "rediss://", "redis+socket://", "sentinel://", "unix://")):
        # A broker that accepts but never answers fails a call instead of hanging
        # the process; kombu then reconnects (BRPOP polls every second, well inside).
        transport.update(socket_connect_timeout=5, socket_timeout=30, socket_keepalive=True)
        # Queues are model.<name> in every deployment; prefixing the broker's keys
        # with the namespace lets several deployments (or test runs) share a Redis
        # without consuming each other's messages. (On RabbitMQ, use a vhost each.)
        transport["global_keyprefix"] = keys.broker_prefix(settings.namespace)
    return {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": 5,
        "broker_transport_options": transport,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_time_limit": settings.hard_time_limit,
        "task_soft_time_limit": settings.backend_timeout + settings.write_grace / 2,
        "task_ignore_result": True,
        "result_backend": None,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # Control tasks (dispatch, ingest, reconcile) go to `control`; solve messages
        # are published by the dispatcher straight to `model.<name>`.
        "task_default_queue": keys.CONTROL_QUEUE,
        "task_create_missing_queues": True,
        # Task events cost three broker messages per task; Flower switches them on
        # (enable_events) while it runs, and lists workers and queues without them.
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        "beat_schedule": {
            "dispatch": {"task": keys.DISPATCH_TASK, "schedule": settings.dispatch_tick, "kwargs": {"from_beat": True},
                         "options": {"expires": 10}},
            "sweep": {"task": keys.SWEEP_TASK, "schedule": settings.sweep_tick, "options": {"expires": 60}},
            "ingest": {"task": keys.INGEST_TASK, "schedule": settings.ingest_tick, "options": {"expires": 60}},
        },
    }


globals().update(from_settings(Settings.from_env()))
