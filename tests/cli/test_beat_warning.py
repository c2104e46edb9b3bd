"""A second beat: the command that would start one says when a beat's dispatch tick ran lately
(an operator started a second `balancer run` beside another, and two beats doubled every tick
with no word anywhere)."""

from __future__ import annotations

import pytest

from balancer.services import Services
from balancer.settings import Settings


def test_a_beat_ticking_already_is_said_by_what_would_start_another(
        migrated: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from balancer.cli.processes import warn_if_a_beat_ticks
    from balancer.dispatch.beat_seen import mark_beat_seen

    svc = Services.connect(Settings.from_env())
    warn_if_a_beat_ticks(svc)
    assert capsys.readouterr().err == ""  # no beat: nothing to say
    mark_beat_seen(svc.redis, svc.settings.namespace, svc.settings.dispatch_tick)  # a beat's dispatch tick
    warn_if_a_beat_ticks(svc)
    err = capsys.readouterr().err
    assert err.startswith("warning: a beat's dispatch tick ran 0.") and "if another beat runs, stop one" in err
    assert err.count("\n") == 1
