"""The per-model circuit breaker (trip.lua), and leases kept across a model's
removal, on the Lua core and the reference model at once (``Twin``), with an
injected clock and hand-made numbers."""

from __future__ import annotations

from balancer.admission.quota import Quota
from balancer.admission.values import CIRCUIT_BASE_MS, CIRCUIT_FAILURES, CIRCUIT_MAX_MS, Admitted, Candidate, NotNow, Settlement
from tests.twin import Twin

ANSWERED = Settlement(used_tokens=10, reserved_tokens=10, latency_ms=50, completion_tokens=5)




def admitted(twin: Twin, n: int) -> list[Admitted]:
    return [d for d in twin.admit([Candidate(10)] * n) if isinstance(d, Admitted)]


def test_repeated_failures_open_the_circuit_and_stop_counting(twin: Twin) -> None:
    twin.set_quota(Quota("a", 8, 600_000, slow_start=False))
    assert CIRCUIT_FAILURES == 3
    assert twin.trip("a") == (True, False)
    assert twin.trip("a") == (True, False)
    assert twin.trip("a") == (False, True)  # the third in a row opens it, and is the backend's fault
    decision = twin.admit([Candidate(10)])[0]
    assert isinstance(decision, NotNow) and decision.wait_ms == CIRCUIT_BASE_MS
    twin.advance(500)
    assert twin.trip("a") == (False, False)  # a call in flight when it opened: no longer pause
    twin.advance(CIRCUIT_BASE_MS - 500)
    probe = admitted(twin, 4)
    assert len(probe) == 1  # open: one call at a time
    assert twin.trip("a") == (False, True)  # the probe failed: pause twice as long
    twin.release(probe[0].admission_id)
    decision = twin.admit([Candidate(10)])[0]
    assert isinstance(decision, NotNow) and decision.wait_ms == 2 * CIRCUIT_BASE_MS
    twin.advance(2 * CIRCUIT_BASE_MS)
    probe = admitted(twin, 4)
    assert len(probe) == 1
    twin.finish(probe[0].admission_id, ANSWERED)  # an answer closes it
    assert len(admitted(twin, 8)) == 8
    assert twin.trip("a") == (True, False)  # counting starts again from zero


def test_failed_probes_back_off_up_to_the_ceiling(twin: Twin) -> None:
    twin.set_quota(Quota("a", 2, 600_000))
    for _ in range(CIRCUIT_FAILURES):
        twin.trip("a")
    pauses = []
    for _ in range(6):
        twin.advance(CIRCUIT_MAX_MS)
        probe = admitted(twin, 2)
        assert len(probe) == 1
        assert twin.trip("a") == (False, True)
        twin.release(probe[0].admission_id)
        pauses.append(twin.core.live(twin.now)["a"].paused_ms)
    assert pauses == [4_000, 8_000, 16_000, CIRCUIT_MAX_MS, CIRCUIT_MAX_MS, CIRCUIT_MAX_MS]


def test_a_task_that_fails_where_others_succeed_keeps_counting(twin: Twin) -> None:
    """A poison task on a healthy model: each of its failures comes after answers,
    so each counts, and its attempts run out as before."""
    twin.set_quota(Quota("a", 4, 600_000))
    for _ in range(10):
        good = admitted(twin, 1)[0]
        twin.finish(good.admission_id, ANSWERED)
        assert twin.trip("a") == (True, False)


def test_failures_in_a_row_on_every_model_stop_counting_before_each_circuit_opens(twin: Twin) -> None:
    """A backend outage fails every model's calls: each model's own first failures used an attempt
    before its circuit opened, and a loaded run's flexible task met them on five models and failed
    (tests/pipeline/test_faults.py). From the third failure in a row anywhere, none counts; an
    answer on any model makes a failure a task's again."""
    for name in "abc":
        twin.set_quota(Quota(name, 4, 600_000, slow_start=False))
    assert twin.trip("a") == (True, False)
    assert twin.trip("b") == (True, False)
    assert twin.trip("c") == (False, False)  # c's first failure, but the third in a row on the backend
    assert twin.trip("a") == (False, False)  # a's circuit is still closed (2 of 3): not the task's either
    assert twin.trip("a") == (False, True)   # a's third opens its circuit, as before
    good = admitted(twin, 1)[0]
    twin.finish(good.admission_id, ANSWERED)  # the backend answers
    assert twin.trip("c") == (True, False)
    twin.check_same_state()


def test_a_removed_model_keeps_its_calls_in_flight_when_created_again(twin: Twin) -> None:
    """Re-creating a model must not forget the calls still running at the provider."""
    twin.set_quota(Quota("a", 3, 600_000))
    running = admitted(twin, 3)
    for call in running:
        twin.renew(call.admission_id, "a", 10)
    twin.remove_quota("a")
    twin.set_quota(Quota("a", 3, 600_000))
    assert admitted(twin, 3) == []  # the three old calls still hold the cap
    twin.finish(running[0].admission_id, ANSWERED)
    assert len(admitted(twin, 3)) == 1
