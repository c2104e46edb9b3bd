"""``balancer flower``: Flower on the pipeline's own broker and Celery app.

``celery -A balancer.pipeline.app flower`` reads the broker from
``BALANCER_BROKER_URL`` (else ``BALANCER_REDIS_URL``) like every balancer
process, but lists only the queues a worker has told it about. This command
resolves the same services as the other commands (the embedded stack when no
URL is set), declares the ``control`` queue and every model's ``model.<name>``
queue, so that Flower's broker page lists each with its length (a model whose
worker is gone shows its messages waiting), and starts Flower. The solve tasks
show as ``balancer.solve@<model>``; the dispatcher's periodic ticks send no
task events, so they stay out of its task list (:mod:`balancer.pipeline.tasks`).
"""

from __future__ import annotations

import click

from balancer.cli import resolved_settings
from balancer.cli.processes import celery_command
from balancer.cli.startwait import migrated


def queue_names(models: list[str]) -> list[str]:
    """The queues Flower's broker page lists: the dispatcher's, and every model's.

    >>> queue_names(["b", "a"])
    ['control', 'model.a', 'model.b']
    """
    from balancer.admission import keys  # (not at import: `balancer --help` loads this module, and no Redis client)

    return [keys.CONTROL_QUEUE, *(keys.model_queue(m) for m in sorted(models))]


def _list_declared_queues_too(names: list[str]) -> None:
    """Flower's pages ask the workers which queues they consume, and fall back to the app's
    queues only when no worker answered: a model whose worker is gone, or has not answered yet,
    would be missing. Its handlers list the declared queues as well."""
    from flower.views import BaseHandler

    reported = BaseHandler.get_active_queue_names

    def every_queue(self: BaseHandler) -> list[str]:
        return sorted(set(reported(self)) | set(names))

    BaseHandler.get_active_queue_names = every_queue


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--address", default="127.0.0.1", show_default=True, help="Address to bind (beyond loopback: set --basic-auth).")
@click.option("--port", default=5555, show_default=True, type=click.IntRange(1, 65535), help="Port Flower listens on.")
@click.pass_context
def flower(ctx: click.Context, address: str, port: int) -> None:
    """Flower on the pipeline's broker and app, every model's queue declared; other Flower options
    (e.g. --basic-auth=user:password) are passed on."""
    resolved_settings()  # exports the URLs the Celery configuration reads
    names = queue_names([q.name for q in migrated().quotas.all()])
    from kombu import Queue

    import balancer.pipeline.tasks  # noqa: F401 - registers the tasks
    from balancer.pipeline.app import app

    app.conf.task_queues = [Queue(name) for name in names]
    _list_declared_queues_too(names)
    click.echo(f"Flower on http://{address}:{port} (queues: {', '.join(names)})", err=True)
    celery_command(app, ["flower", f"--address={address}", f"--port={port}", *ctx.args])
