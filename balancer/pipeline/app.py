"""The Celery app. Configuration lives in the top-level ``celeryconfig.py``."""

from celery import Celery

from balancer.pipeline import kombu_redis, ticklog
from balancer.pipeline.reconnect import PromptAMQP

kombu_redis.install()  # workers survive a Redis broker that dies (see the module)
ticklog.install()  # the periodic ticks' log lines at DEBUG
app = Celery("balancer", amqp=PromptAMQP)  # a lost broker is tried again within a second (see the module)
app.config_from_object("celeryconfig")
app.autodiscover_tasks(["balancer.pipeline"], related_name="tasks", force=True)
