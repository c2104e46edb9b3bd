"""``balancer metrics`` scraped over HTTP during a real run, checked against the simulator's own log."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_match_the_simulator_log(tmp_path: Path) -> None:
    """Three models; every call to model-1 answers 429 for a while. The exporter
    is scraped every 0.2 s during the run: in-flight never exceeds a cap; at the
    end, solved calls and 429s per model equal the simulator's log exactly."""
    from balancer.devtools.embedded import free_port
    from balancer.supervisor import wait_for_http
    from tests.pipeline_harness import Pipeline, prompt_lines

    p = Pipeline(tmp_path / "logs", model_count=3, extra_env={"BALANCER_HEDGE_BUDGET": "0"})
    try:
        p.start()
        port = free_port()
        exporter = p.supervisor.start("metrics", ["metrics", "--port", str(port), "--finished-every", "0"])
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for_http(url, child=exporter)
        caps = {m.name: m.max_concurrent_requests for m in p.models}
        faults = {"status": {"model-1": 429}, "retry_after": {"model-1": 0.3}}
        httpx.post(f"{p.backend_url}/admin/faults", json=faults, timeout=5).raise_for_status()
        ids = p.submit(prompt_lines(60, list(caps)))
        peak: Counter[str] = Counter()
        lifted = False
        deadline = time.monotonic() + 120
        while True:
            samples = scrape(url)
            for (name, labels), value in samples.items():
                if name == "balancer_model_in_flight":
                    model = dict(labels)["model"]
                    peak[model] = max(peak[model], int(value))
            if not lifted and sum(1 for e in p.sim_log() if e["status"] == 429) >= 3:
                httpx.post(f"{p.backend_url}/admin/faults", json={}, timeout=5).raise_for_status()
                lifted = True
            counts = p.counts()
            if lifted and counts["solved"] + counts["failed"] >= len(ids):
                break
            assert time.monotonic() < deadline, counts
            time.sleep(0.2)
        assert all(peak[m] <= caps[m] for m in caps), (peak, caps)
        assert sum(peak.values()) > 0  # the scrapes saw calls in flight
        log = p.sim_log()
        samples = scrape(url)
        refill_gaps = 0.0
        for model in caps:
            def calls(outcome: str, model: str = model) -> float:
                return samples[("balancer_model_calls_total", (("model", model), ("outcome", outcome)))]

            assert calls("solved") == sum(1 for e in log if e["model"] == model and e["status"] == 200)
            assert calls("rate_limited") == sum(1 for e in log if e["model"] == model and e["status"] == 429)
            histogram_count = samples[("balancer_model_call_latency_seconds_count", (("model", model),))]
            assert histogram_count == calls("solved")
            assert samples[("balancer_model_max_concurrent_requests", (("model", model),))] == caps[model]
            # Each refill gap starts with a call that ended on a full model: never more gaps than calls.
            gaps = samples[("balancer_model_refill_gap_seconds_count", (("model", model),))]
            assert gaps <= sum(1 for e in log if e["model"] == model)
            refill_gaps += gaps
        assert refill_gaps > 0  # 60 tasks on three models: some slot of a full model was refilled
        assert samples[("balancer_model_calls_total", (("model", "model-1"), ("outcome", "rate_limited")))] >= 3
        assert samples[("balancer_tasks", (("status", "solved"),))] == p.counts()["solved"]
        assert samples[("balancer_dispatch_rounds_total", ())] > 0
        assert samples[("balancer_admission_decisions_total", (("decision", "admitted"),))] >= len(ids)
        assert p.violations() == []
    finally:
        p.stop()


@pytest.mark.parametrize("token", [None, "m3trics-t0ken"])
def test_metrics_are_served_on_one_path_and_with_a_token_only_to_its_bearer(token: str | None) -> None:
    """/metrics only (before: any path, /foo included, served them), and with
    BALANCER_METRICS_TOKEN only for ``Authorization: Bearer <token>``."""
    from balancer.devtools.embedded import free_port
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.views.metrics import serve

    port = free_port()
    server = serve(Services.connect(Settings.from_env()), "127.0.0.1", port, finished_every=0, token=token)
    try:
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        for path in ("/", "/foo", "/metrics/", "/metricsx"):
            assert httpx.get(url + path, headers=auth, timeout=10).status_code == 404, path
        answer = httpx.get(f"{url}/metrics", headers=auth, timeout=10)
        assert answer.status_code == 200 and "balancer_tasks" in answer.text
        # a page of another site rebound to loopback names its own host: refused (before: served)
        rebound = httpx.get(f"{url}/metrics", headers={**auth, "Host": f"rebind.attacker.example:{port}"}, timeout=10)
        assert rebound.status_code == 400 and "balancer_" not in rebound.text
        assert httpx.get(f"{url}/metrics", headers={**auth, "Host": f"localhost:{port}"}, timeout=10).status_code == 200
        if token:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                refused = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
                assert refused.status_code == 401 and "balancer_" not in refused.text
                assert refused.headers["www-authenticate"] == "Bearer"
    finally:
        server.shutdown()
        server.server_close()


def test_a_scrape_that_trickles_its_request_is_closed_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending a byte now and then never lets a per-read timeout fire: the exporter
    closes the connection once the whole request has taken longer than READ_TIMEOUT_S (before:
    still open while the bytes kept coming), and goes on serving scrapes."""
    import socket

    from balancer.devtools.embedded import free_port
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.views import metrics

    monkeypatch.setattr(metrics, "READ_TIMEOUT_S", 1.0)
    port = free_port()
    server = metrics.serve(Services.connect(Settings.from_env()), "127.0.0.1", port, finished_every=0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.settimeout(0.3)
            opened, closed_after = time.monotonic(), None
            for byte in b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                try:
                    slow.sendall(bytes([byte]))
                    if slow.recv(1024) == b"":
                        closed_after = time.monotonic() - opened
                        break
                except TimeoutError:
                    continue  # still open: the next byte
                except OSError:
                    closed_after = time.monotonic() - opened
                    break
            assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
        assert closed_after is not None and closed_after < 4, closed_after
    finally:
        server.shutdown()
        server.server_close()
