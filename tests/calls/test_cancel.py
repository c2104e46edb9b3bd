"""Cutting off a call in flight: the HTTP request is closed and the caller gets ``Cancelled``.

The backend here is a real TCP server that reads the request and never
answers, as a hung provider call does; the backend timeout is far longer
than the test waits, so only a cancellation can end the call.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import redis

from balancer.backends import BackendError, Cancelled, Transient
from balancer.backends.cancel import CallHandle, cancellable
from balancer.backends.models_backend import ModelsBackend
from balancer.calls.cancellation import CancelListener, cancel_call

HUNG_TIMEOUT_S = 120.0


@pytest.fixture
def silent_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """(base URL, accepted connections) of a server that never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    server.close()
    for conn in accepted:
        conn.close()


def call_in_thread(call: Callable[[], object]) -> tuple[threading.Thread, dict[str, BaseException]]:
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    while not condition() and not done.wait(0.02):
        pass
    deadline.cancel()


def test_a_hung_call_is_cut_off_and_the_server_sees_the_client_go(silent_server) -> None:  # noqa: ANN001
    url, accepted = silent_server
    backend = ModelsBackend(url, timeout=HUNG_TIMEOUT_S)
    handles: list[CallHandle] = []

    def call() -> None:
        with cancellable() as handle:
            handles.append(handle)
            backend.complete("m", "hello", 5)

    thread, outcome = call_in_thread(call)
    wait_until(lambda: bool(accepted) and bool(handles))
    conn = accepted[0]
    conn.settimeout(10)
    received = b""
    while b"\r\n\r\n" not in received:  # the request is on the wire: the call now waits for an answer
        chunk = conn.recv(65536)
        assert chunk, "the client closed before sending its request"
        received += chunk
    assert received.startswith(b"POST /single")
    handles[0].cancel()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], Cancelled)
    while conn.recv(65536):  # the rest of the body, then end of stream (a timeout here fails the test)
        pass


def test_a_call_cancelled_before_it_is_sent_never_reaches_the_backend(silent_server) -> None:  # noqa: ANN001
    url, accepted = silent_server
    backend = ModelsBackend(url, timeout=HUNG_TIMEOUT_S)
    with cancellable() as handle:
        handle.cancel()
        with pytest.raises(Cancelled):
            backend.complete("m", "hello", 5)
    for conn in accepted:
        conn.settimeout(10)
        assert conn.recv(65536) == b""


def test_an_uncancelled_failure_stays_transient() -> None:
    """A refused connection inside a cancellable block is a transient error, not a cancel."""
    port = socket.create_server(("127.0.0.1", 0))
    address = port.getsockname()[1]
    port.close()
    with cancellable(), pytest.raises(BackendError) as caught:
        ModelsBackend(f"http://127.0.0.1:{address}", timeout=5).complete("m", "hello", 5)
    assert isinstance(caught.value, Transient)


def test_a_cancel_published_on_the_channel_reaches_the_call(
    silent_server, redis_client: redis.Redis, namespace: str  # noqa: ANN001
) -> None:
    url, accepted = silent_server
    backend = ModelsBackend(url, timeout=HUNG_TIMEOUT_S)
    listener = CancelListener(redis_client, namespace)
    try:
        def call(admission_id: str) -> Callable[[], object]:
            def run() -> object:
                with listener.watch(admission_id):
                    return backend.complete("m", "hello", 5)
            return run

        first, first_outcome = call_in_thread(call("lease-1"))
        second, second_outcome = call_in_thread(call("lease-2"))
        wait_until(lambda: len(accepted) == 2)
        assert cancel_call(redis_client, namespace, "lease-2") >= 1
        second.join(10)
        assert not second.is_alive() and isinstance(second_outcome["error"], Cancelled)
        assert first.is_alive()  # only the named call was cut off
        cancel_call(redis_client, namespace, "lease-1")
        first.join(10)
        assert not first.is_alive() and isinstance(first_outcome["error"], Cancelled)
    finally:
        listener.close()


def test_each_model_calls_through_its_own_connection_pool(silent_server) -> None:  # noqa: ANN001
    """One pool per model: with room for one connection per pool, a hung call on
    model a does not hold back a call on model b (one shared pool would), and
    each model's threads queue only for their own pool's lock."""
    url, accepted = silent_server
    backend = ModelsBackend(url, timeout=HUNG_TIMEOUT_S, max_connections=1)
    calls = [call_in_thread(lambda model=model: backend.complete(model, "p", 1)) for model in ("a", "b")]
    wait_until(lambda: len(accepted) == 2)
    assert len(accepted) == 2
    for conn in accepted:  # the server hangs up: both calls end, as transient failures
        conn.close()
    for thread, outcome in calls:
        thread.join(10)
        assert isinstance(outcome.get("error"), Transient)
    backend.close()


def test_every_models_pool_shares_one_tls_context() -> None:
    """A model's first call makes its pool; building a TLS context for each
    (what httpx does by default: 46 ms of CPU, under the backend's lock) held
    every model's first calls back at the start of a run, past their start
    gates, and they reached RPM-over-1-s providers together (429s)."""
    backend = ModelsBackend("http://127.0.0.1:9", timeout=HUNG_TIMEOUT_S)
    pools = [backend._client(model)._transport._pool for model in ("a", "b", "c")]  # type: ignore[attr-defined]
    assert len({id(pool) for pool in pools}) == 3  # one pool per model
    assert len({id(pool._ssl_context) for pool in pools}) == 1  # and one TLS context for all
    backend.close()
