"""The simulated Models Backend enforces limits like a provider, and its audit catches breaches."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from balancer.devtools.sim.audit import Call, Limits, audit, peaks
from balancer.devtools.sim.config import Latency, SimModel, default_models
from balancer.devtools.sim.limiter import ModelLimiter
from balancer.devtools.sim.provider import Simulator
from balancer.devtools.sim.server import create_app

FAST = Latency(0.05, 0.05, 0.05, 0.05)


def client_for(sim: Simulator) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(sim)), base_url="http://sim")


def test_concurrency_and_tpm_are_enforced_with_retry_after() -> None:
    sim = Simulator([SimModel("m", 2, 60_000, burst_tokens=700, latency=FAST)], grace=0.0)

    async def go() -> list[httpx.Response]:
        async with client_for(sim) as client:
            calls = [client.post("/single", json={"model": "m", "prompt": "x" * 40, "max_tokens": 100}) for _ in range(4)]
            return await asyncio.gather(*calls)

    replies = asyncio.run(go())
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 200, 429, 429]  # cap 2
    limited = [r for r in replies if r.status_code == 429]
    assert all(float(r.headers["Retry-After"]) > 0 for r in limited)
    assert [e["status"] for e in sim.log].count(429) == 2


def test_a_call_still_running_is_listed_until_it_ends_then_logged() -> None:
    """The log has a call only once it ends; a hedge's loser can outlast a run, so ``/log`` with
    ``running`` also lists, in the same read, the calls admitted and not yet ended, with what the
    provider counted for them."""
    sim = Simulator([SimModel("m", 2, 60_000, latency=Latency(0.3, 0.3, 0.3, 0.3))], grace=0.0)

    async def go() -> tuple[dict, dict, httpx.Response]:
        async with client_for(sim) as client:
            call = asyncio.ensure_future(client.post("/single", json={"model": "m", "prompt": "x" * 40, "max_tokens": 100}))
            for _ in range(500):  # at most 5 s
                if sim.running or call.done():
                    break
                await asyncio.sleep(0.01)
            during = (await client.get("/log", params={"running": "true"})).json()
            reply = await call
            return during, (await client.get("/log", params={"running": "true"})).json(), reply

    during, after, reply = asyncio.run(go())
    assert reply.status_code == 200
    assert during["entries"] == []
    [call] = during["running"]
    assert (call["model"], call["charge"], call["counted"], call["client_gone"]) == ("m", 110, 110, False)
    assert call["start"] <= during["at"]  # (reserve: counted on arrival)
    assert after["running"] == []
    assert [(e["status"], e["prompt_key"]) for e in after["entries"]] == [(200, call["prompt_key"])]


def test_a_call_still_running_says_whether_its_client_has_gone() -> None:
    """A call whose client went runs on (``on_disconnect = "continue"``): listed as running,
    its client gone, as the log will say once it ends."""
    sim = Simulator([SimModel("m", 2, 60_000, latency=Latency(0.3, 0.3, 0.3, 0.3))], grace=0.0)

    async def go() -> tuple[list[dict], list[dict]]:
        call = asyncio.ensure_future(sim.call("m", "x" * 40, 100, "single", gone=lambda: asyncio.sleep(0)))
        for _ in range(500):  # at most 5 s
            if sim.running and all(w is not None and w.done() for _, w in sim.running.values()):
                break
            await asyncio.sleep(0.01)
        with sim._lock:
            during = sim.still_running()
        await call
        return during, sim.log

    during, log = asyncio.run(go())
    assert [c["client_gone"] for c in during] == [True]
    assert [(e["status"], e["client_gone"]) for e in log] == [(200, True)]


def test_token_bucket_429_says_when() -> None:
    lim = ModelLimiter(cap=10, tpm=6_000, rpm=None, burst=1_000, grace=0.0, now=0.0)
    assert lim.try_start(0.0, 1_000) == (True, 0.0)
    ok, retry_after = lim.try_start(0.0, 500)
    assert not ok and retry_after == pytest.approx(5.0)  # 500 tokens at 100/s
    assert lim.try_start(5.0, 500)[0]


def test_rpm_enforced() -> None:
    lim = ModelLimiter(cap=1000, tpm=10**9, rpm=60, burst=10**9, grace=0.0, now=0.0)
    assert all(lim.try_start(0.0, 1)[0] for _ in range(60))
    ok, retry_after = lim.try_start(0.0, 1)
    assert not ok and retry_after == pytest.approx(1.0)


def test_batch_spreads_round_robin_and_waits_for_all() -> None:
    models = [SimModel(f"m{i}", 10, 10**6, latency=Latency(0.01 * (i + 1), 0.01 * (i + 1), 0.0, 1.0)) for i in range(3)]
    sim = Simulator(models)

    async def go() -> httpx.Response:
        async with client_for(sim) as client:
            return await client.post("/batch", json={"prompts": [f"p{i}" for i in range(6)]})

    reply = asyncio.run(go())
    results = reply.json()["results"]
    assert [r["model"] for r in results] == ["m0", "m1", "m2", "m0", "m1", "m2"]
    assert all(r["status"] == 200 and r["answer"] for r in results)


def test_a_task_costs_the_same_on_a_model_in_every_run() -> None:
    """Common random numbers: the pipeline and the baseline (two simulators with
    the scenario's seed) see the same latency and answer length for a task on a
    given model, whatever order the calls arrive in."""
    lat = Latency(0.01, 0.2, 0.001, 0.3)
    models = [SimModel("a", 50, 10**7, latency=lat), SimModel("b", 50, 10**7, latency=lat)]

    def run(order: list[str], seed: int = 7) -> dict[tuple[str, str], tuple[float, int]]:
        sim = Simulator(models, seed=seed)
        sent = [(model, prompt) for prompt in order for model in ("a", "b")]

        async def go() -> None:
            async with client_for(sim) as client:
                for model, prompt in sent:
                    await client.post("/single", json={"model": model, "prompt": prompt, "max_tokens": 500})

        asyncio.run(go())
        return {key: (e["end"] - e["start"], e["completion_tokens"]) for key, e in zip(sent, sim.log)}

    prompts = [f"prompt {i}" for i in range(12)]
    first, reordered, other_seed = run(prompts), run(prompts[::-1]), run(prompts, seed=8)
    assert {k: v[1] for k, v in first.items()} == {k: v[1] for k, v in reordered.items()}
    # Each call lasted its own draw, which depends on (seed, model, prompt) only. Measured
    # durations are only ever longer than the draw (a loaded machine sleeps late), so
    # the check is one-sided rather than a tolerance on wall-clock jitter.
    draws = {(model, prompt): Simulator(models, seed=7).draw(model, prompt, 500)[0] for model, prompt in first}
    assert all(first[k][0] >= draws[k] - 0.002 and reordered[k][0] >= draws[k] - 0.002 for k in first)
    assert max(draws.values()) - min(draws.values()) > 0.05  # still random across tasks and models
    assert {k: v[1] for k, v in other_seed.items()} != {k: v[1] for k, v in first.items()}  # the seed matters


def test_untagged_draws_give_a_tagged_batch_the_same_dice_and_only_when_asked() -> None:
    models = default_models(3)
    tagged, plain = Simulator(models, seed=7, untagged_draws=True), Simulator(models, seed=7)
    for model in ("model-0", "model-2"):
        for prompt in ("prompt 1", "prompt 2 [x] y"):
            assert tagged.draw(model, f"[batch-2] {prompt}", 500) == tagged.draw(model, f"[batch-3] {prompt}", 500) \
                == plain.draw(model, prompt, 500)
            assert plain.draw(model, f"[batch-2] {prompt}", 500) != plain.draw(model, f"[batch-3] {prompt}", 500)
    assert tagged.draw("model-1", "[not a tag", 500) == plain.draw("model-1", "[not a tag", 500)


def test_latency_is_heavy_tailed_and_clipped() -> None:
    import random

    lat = default_models()[2].latency
    rng = random.Random(1)
    samples = sorted(lat.sample(rng) for _ in range(5_000))
    assert samples[0] >= 1.0 and samples[-1] <= 120.0
    assert samples[2_500] == pytest.approx(lat.median, rel=0.15)
    assert lat.mean() > lat.median * 1.3  # a long right tail


def test_audit_flags_each_kind_of_breach() -> None:
    limits = {"m": Limits(cap=2, tpm=600, rpm=6, burst=100)}
    assert audit([Call(0, 1, "m", 50), Call(0.5, 1.5, "m", 50)], limits) == []
    over_cap = [Call(0, 2, "m", 1)] * 3
    assert {v.kind for v in audit(over_cap, limits)} == {"concurrency"}
    burst = [Call(t, t + 0.1, "m", 60) for t in (0.0, 0.2)]  # 120 tokens at once > 100 + 10/s x 0.2 s
    assert {v.kind for v in audit(burst, limits)} == {"tokens"}
    spaced = [Call(t, t + 0.1, "m", 60) for t in (0.0, 10.0)]  # 10 s later the bucket has refilled
    assert audit(spaced, limits) == []
    rapid = [Call(i * 0.2, i * 0.2 + 0.1, "m", 1) for i in range(8)]
    assert {v.kind for v in audit(rapid, limits)} == {"requests"}
    assert peaks(spaced, window=60.0)["m"].tokens_per_60s == 120


def test_real_limits_are_shares_of_the_quota_and_change_mid_run() -> None:
    """A model whose provider really allows a tenth of its quota's RPM and of its
    cap, halved 10 s after its first call and restored 10 s later; its limit
    headers can be hidden while the remaining counts are sent."""
    model = SimModel("m", 40, 600_000, max_requests_per_minute=600, real_requests=0.1, real_concurrency=0.1,
                     limit_changes=((10.0, 0.5), (20.0, 1.0)), limit_headers=False, latency=FAST)
    assert model.quota().max_requests_per_minute == 600                      # what balancer is given
    real = model.real_quota()
    assert (real.max_requests_per_minute, real.request_burst, real.max_concurrent_requests) == (60, 60, 4)
    lim = model.limiter(time_scale=1.0, grace=0.0, now=0.0)
    assert sum(lim.try_start(0.0, 1)[0] for _ in range(10)) == 4             # cap 4
    assert lim.refused_by == "concurrency"
    lim.in_flight = 0
    lim.try_start(10.0, 1)                                                   # 10 s after the first call: halved
    assert (lim.cap, lim.rpm, lim.request_burst) == (2, 30, 30)
    lim.in_flight = 0
    lim.try_start(20.0, 1)                                                   # restored
    assert (lim.cap, lim.rpm, lim.request_burst) == (4, 60, 60)
    headers = Simulator([model]).rate_limit_headers("m", 0.0)
    assert "x-ratelimit-remaining-requests" in headers and "x-ratelimit-limit-requests" not in headers


@pytest.mark.parametrize(("headers_at", "left"), [("admission", 40_000 - 110), ("response", 40_000 - 220)])
def test_remaining_counts_are_taken_at_admission_by_default_or_at_the_response(headers_at: str, left: int) -> None:
    """Issue 39 deliverable 1: a provider (or a proxy's limiter) that stamps its remaining counts
    as it admits a call sends counts as old as the call: a call admitted after this one and
    still running when this one ends is not in them. ``headers_at = "response"`` counts it."""
    slow, fast = Latency(0.4, 0.4, 0.4, 0.4), Latency(0.01, 0.01, 0.01, 0.01)
    model = SimModel("m", 4, 60, burst_tokens=40_000, latency=slow, headers_at=headers_at)
    sim = Simulator([model], time_scale=1.0)
    assert SimModel("m", 1, 1).headers_at == "admission"

    async def go() -> httpx.Response:
        async with client_for(sim) as client:
            first = asyncio.ensure_future(client.post("/single", json={"model": "m", "prompt": "x" * 40, "max_tokens": 100}))
            await asyncio.sleep(0.1)
            sim.models["m"] = SimModel("m", 4, 60, burst_tokens=40_000, latency=fast, headers_at=headers_at)
            await client.post("/single", json={"model": "m", "prompt": "y" * 40, "max_tokens": 100})
            return await first

    reply = asyncio.run(go())
    # 110 tokens a call, a refill of 1 token/s: one call's charge (this one's) at admission, two at the response.
    assert int(reply.headers["x-ratelimit-remaining-tokens"]) == pytest.approx(left, abs=1)
