"""Dispatch requests: the flag that coalesces them across processes (real Redis)."""

from __future__ import annotations

import redis

from balancer.admission import keys
from balancer.dispatch.trigger import clear_requests, request_dispatch


def test_one_request_per_burst_until_a_run_clears_the_flag(redis_client: redis.Redis, namespace: str) -> None:
    sent: list[float] = []
    assert request_dispatch(redis_client, namespace, sent.append)
    assert not request_dispatch(redis_client, namespace, sent.append)  # one already on its way
    clear_requests(redis_client, namespace)  # a dispatch run starts
    assert request_dispatch(redis_client, namespace, sent.append)
    assert sent == [0.0, 0.0]
    assert redis_client.pttl(keys.dispatch_flags(namespace)[0]) > 0  # it expires by itself if the message is lost


def test_a_delayed_request_due_sooner_than_the_one_on_its_way_is_sent(redis_client: redis.Redis, namespace: str) -> None:
    """A round slow start asks for in 60 ms is not held back by a token wait's 900 ms on its way."""
    sent: list[float] = []
    assert request_dispatch(redis_client, namespace, sent.append, delay_ms=900)
    assert not request_dispatch(redis_client, namespace, sent.append, delay_ms=900)  # the same: coalesced
    assert request_dispatch(redis_client, namespace, sent.append, delay_ms=60)
    assert not request_dispatch(redis_client, namespace, sent.append, delay_ms=60)  # no sooner: coalesced
    assert sent == [0.9, 0.06]
    assert 0 < redis_client.pttl(keys.dispatch_flags(namespace)[1]) <= 60  # the flag now expires with the sooner one


def test_the_flag_script_does_not_keep_a_client_alive(redis_client: redis.Redis, namespace: str) -> None:
    """The script runs by its digest, with no client kept: a cache of a script per client held up
    to eight clients, and their connection pools, alive."""
    import gc
    import weakref

    client = redis.Redis(connection_pool=redis.ConnectionPool(**redis_client.connection_pool.connection_kwargs))
    sent: list[float] = []
    assert request_dispatch(client, namespace, sent.append, delay_ms=900) and sent == [0.9]
    gone = weakref.ref(client)
    client.close()
    del client
    gc.collect()
    assert gone() is None


def test_the_flag_script_is_sent_whole_to_a_redis_that_has_not_cached_it(redis_client: redis.Redis,
                                                                           namespace: str) -> None:
    """A Redis that has not seen the script (restarted, or failed over to a replica) answers its
    digest with NOSCRIPT: the script is sent whole, and the request goes out."""

    class Forgetful(redis.Redis):
        def evalsha(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise redis.exceptions.NoScriptError("NOSCRIPT No matching script")

    client = Forgetful(connection_pool=redis_client.connection_pool)
    sent: list[float] = []
    assert request_dispatch(client, namespace, sent.append, delay_ms=300) and sent == [0.3]
    assert not request_dispatch(client, namespace, sent.append, delay_ms=300)  # the flag it set holds the next
    assert 0 < redis_client.pttl(keys.dispatch_flags(namespace)[1]) <= 300
