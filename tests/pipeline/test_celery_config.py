"""The Celery settings the pipeline's guarantees depend on."""

from __future__ import annotations

import dataclasses

import pytest

from balancer.errors import ConfigError
from balancer.settings import Settings


def test_delivery_settings(env: dict[str, str]) -> None:
    from balancer.pipeline.app import app

    conf = app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.task_ignore_result and conf.result_backend is None
    assert conf.task_serializer == "json" and list(conf.accept_content) == ["json"]
    visibility = conf.broker_transport_options["visibility_timeout"]
    assert conf.task_time_limit < visibility
    settings = Settings.from_env()
    assert settings.backend_timeout < conf.task_time_limit < visibility
    assert settings.heartbeat_seconds * 3 == settings.lease_seconds  # a live call's lease is renewed, not outlasted
    assert max(e["schedule"] for e in conf.beat_schedule.values()) < visibility
    assert set(conf.beat_schedule) == {"dispatch", "sweep", "ingest"}


@pytest.mark.parametrize("change", [{"visibility_timeout": 100}, {"visibility_timeout": 180}])
def test_timing_that_could_redeliver_a_running_call_is_refused(change: dict) -> None:
    settings = dataclasses.replace(Settings.from_env(), **change)
    with pytest.raises(ConfigError, match="hard time limit"):
        settings.check_timing()


def test_a_lease_shorter_than_a_call_is_allowed_because_it_is_heartbeated() -> None:
    settings = dataclasses.replace(Settings.from_env(), lease_seconds=30, backend_timeout=150)
    settings.check_timing()  # no error: the heartbeat renews it every 10 s


def test_a_worker_leaves_its_start_up_objects_out_of_garbage_collection() -> None:
    """On worker_ready, everything start-up made goes to the permanent
    generation: full collections then scan only what the run makes (they
    stopped a worker for 60 to 170 ms every second or two under load)."""
    import gc

    from celery.signals import worker_ready

    from balancer.pipeline.tasks import freeze_startup_objects

    assert any(getattr(ref(), "__name__", None) == freeze_startup_objects.__name__
               for _, ref in worker_ready.receivers)  # connected (receivers are weak references)
    try:
        worker_ready.send(sender=None)
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()


def test_a_lost_broker_is_tried_again_within_a_second_not_after_kombus_growing_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every broker connection of the app (consumers, beat, producers) retries a refused broker at
    0.25, 0.5, 0.75, 1.0, 1.0 ... s; kombu's own waits were 2, 4, 6 ... 30 s, which after a Redis
    failover kept workers away for seconds after the new master answered (and waits growing to 2 s
    brought the dispatcher back 1.4 s after it). (kombu's sleeps are skipped here: the waits it
    asks for are what is checked.)"""
    import kombu.exceptions
    import kombu.utils.functional

    from balancer.devtools.embedded import free_port
    from balancer.pipeline.app import app

    monkeypatch.setattr(kombu.utils.functional, "sleep", lambda seconds: None)
    waits: list[float] = []
    for connection in (app.connection_for_read(f"redis://127.0.0.1:{free_port()}/0"),
                       app.connection_for_write(f"redis://127.0.0.1:{free_port()}/0")):
        with connection, pytest.raises(kombu.exceptions.OperationalError):
            connection.ensure_connection(lambda exc, interval: waits.append(interval), max_retries=5)
    assert waits == [0.25, 0.5, 0.75, 1.0, 1.0] * 2, waits
