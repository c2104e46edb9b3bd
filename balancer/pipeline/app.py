"""The Celery app. Configuration lives in the top-level ``celeryconfig.py``."""

from celery import Celery

app = Celery("balancer")
app.config_from_object("celeryconfig")
app.autodiscover_tasks(["balancer.pipeline"], related_name="tasks", force=True)
