"""``balancer web``: the web console (balancer.web)."""

from __future__ import annotations

import click

from balancer.cli.pipeline import _migrated
from balancer.errors import BalancerError, ConfigError


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; beyond loopback BALANCER_WEB_TOKEN is required.")
@click.option("--port", default=8800, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="A name the console is reached by (a DNS name, a reverse proxy's), beside the bound address; "
                   "requests naming any other Host are refused (DNS rebinding). Repeatable.")
@click.option("--sample-interval", default=2.0, show_default=True, type=click.FloatRange(0.1, 60),
              help="Seconds between the console's reads of the live state (its 15-minute history keeps one per read).")
def web(host: str, port: int, allow_hosts: tuple[str, ...], sample_interval: float) -> None:
    """Serve the web console: models, the drain, sources, tasks (retry, cancel)
    and quotas (change, audit), read from Redis and PostgreSQL as `status` does."""
    try:
        from balancer.router.server import listening_sockets, serve
        from balancer.web.app import create_app
        from balancer.web.security import start_refusal
    except ImportError as exc:
        raise BalancerError(f"the web console needs its extra: pip install 'balancer[web]' ({exc.name} is missing)") from None
    token = _token()
    refusal = start_refusal(host, token)
    if refusal is not None:  # refused before connecting to anything
        raise ConfigError(refusal)
    svc = _migrated()
    _, served = create_app(svc, token=token, sample_interval=sample_interval, bound=host, allow_hosts=allow_hosts)
    sockets = listening_sockets(host, port)
    click.echo(f"web console on http://{host}:{port} (token {'required' if token else 'not required'})", err=True)
    serve(served, host, port, sockets=sockets, log_level="warning", access_log=False)  # each request read within a deadline


def _token() -> str | None:
    from balancer.settings import Settings

    return Settings.from_env().web_token
