"""Every Redis key name balancer uses, in one module (as arq's ``constants.py``).

All admission keys start with the hash tag ``{namespace}``, so they land in one
Redis Cluster slot and one Lua script may touch any of them. The broker's keys
(Celery's queues and unacked sets) use the plain prefix ``namespace:`` instead,
set through kombu's ``global_keyprefix``.

>>> script_keys("prod")
['{prod}:meta', '{prod}:models', '{prod}:leases']
>>> model("prod", "gpt-a"), inflight("prod", "gpt-a"), latency("prod", "gpt-a")
('{prod}:model:gpt-a', '{prod}:inflight:gpt-a', '{prod}:latency:gpt-a')
>>> namespace_patterns("prod")
('{prod}*', 'prod:*')

The Lua scripts build per-model keys from the same infixes; the loader
prepends :data:`LUA_PRELUDE`, so these strings are spelled nowhere else.

The broker's names live here too: the queues (``control``, ``model.<name>``)
and the Celery tasks' names, the periodic ticks among them.

>>> model_queue("gpt-a"), queue_model("model.gpt-a"), queue_model("control")
('model.gpt-a', 'gpt-a', None)
"""

from __future__ import annotations

META = ":meta"
MODELS = ":models"
LEASES = ":leases"
MODEL_INFIX = ":model:"
INFLIGHT_INFIX = ":inflight:"
LATENCY_INFIX = ":latency:"
STATS_INFIX = ":stats:"
READY_INFIX = ":ready:"
WINDOW_INFIX = ":window:"
SYSTEM_STATS = ":stats"
DISPATCH_REQUESTED = ":dispatch:requested"
DISPATCH_TIMER = ":dispatch:timer"
DISPATCH_ASKED = ":dispatch:asked"
DISPATCH_RUNNING = ":dispatch:running"
CANCEL_CHANNEL = ":cancel"
CANCELLED_INFIX = ":cancelled:"
BEAT_SEEN = ":beat:seen"
ROUTER_ADMISSION_INFIX = ":router:admission:"
ROUTER_IDEMPOTENCY_INFIX = ":router:idempotency:"
LIVE_CALLS = ":calls:live"
FAIR_SHARES = ":fairshare"
FAIR_SHARED = ":fairshare:shared"
LAST_FAILURE_INFIX = ":failure:"
SOURCE_READ_ERRORS = ":source_read_errors"
CONSUMERS_INFIX = ":consumers:"
CONSUMERS_HEARD = ":consumers"

#: The dispatcher's queue: its ticks (dispatch, sweep, ingest) and every task not sent elsewhere.
CONTROL_QUEUE = "control"
#: Each model's queue is this prefix and its name: its solve messages.
MODEL_QUEUE_PREFIX = "model."
#: The Celery tasks, by name: a model's call, and the periodic ticks beat (or the dispatcher) sends.
SOLVE_TASK = "balancer.solve"
DISPATCH_TASK = "balancer.dispatch"
SWEEP_TASK = "balancer.sweep"
INGEST_TASK = "balancer.ingest"
TICK_TASKS = (DISPATCH_TASK, SWEEP_TASK, INGEST_TASK)


def solve_shown(model: str) -> str:
    """The name a model's solve messages show in logs and events (Flower's task list): the task's and
    the model's (Celery's ``shadow`` name; the worker runs :data:`SOLVE_TASK`).

    >>> solve_shown("gpt-a")
    'balancer.solve@gpt-a'
    """
    return f"{SOLVE_TASK}@{model}"


def model_queue(name: str) -> str:
    """The Celery queue of a model's solve messages."""
    return MODEL_QUEUE_PREFIX + name


def queue_model(queue: str) -> str | None:
    """The model whose queue this is (None: not a model's queue)."""
    return queue[len(MODEL_QUEUE_PREFIX):] if queue.startswith(MODEL_QUEUE_PREFIX) else None


def tag(namespace: str) -> str:
    """The hash tag every admission key starts with."""
    return "{" + namespace + "}"


def script_keys(namespace: str) -> list[str]:
    """KEYS[1..3] of every admission script: meta, models, leases."""
    t = tag(namespace)
    return [t + META, t + MODELS, t + LEASES]


def model(namespace: str, name: str) -> str:
    """A model's hash: limits, buckets, deficit, quota generation."""
    return tag(namespace) + MODEL_INFIX + name


def inflight(namespace: str, name: str) -> str:
    """A model's zset of live leases: admission id -> lease deadline (ms)."""
    return tag(namespace) + INFLIGHT_INFIX + name


def ready(namespace: str, name: str) -> str:
    """A model's ready list: tasks the dispatcher placed on it ahead of a free slot,
    each ``task_id:admission_id:estimated_tokens:expires_ms`` (see stock.lua)."""
    return tag(namespace) + READY_INFIX + name


def window(namespace: str, name: str) -> str:
    """A model's window list, with a window cap: ``admitted_ms:tokens`` per admission of the
    window (a minute and the hop), oldest first (see :mod:`balancer.admission.window`)."""
    return tag(namespace) + WINDOW_INFIX + name


def latency(namespace: str, name: str) -> str:
    """A model's latency sketch (balancer.estimates.latency): bucket counts and token sums."""
    return tag(namespace) + LATENCY_INFIX + name


def stats(namespace: str, name: str) -> str:
    """A model's counters since the start (hash): calls by outcome, tokens, latency buckets.

    Observation only, never read by admission; ``balancer metrics`` exports them.
    """
    return tag(namespace) + STATS_INFIX + name


def system_stats(namespace: str) -> str:
    """Counters of the whole system (hash): admission decisions by kind, dispatch rounds."""
    return tag(namespace) + SYSTEM_STATS


def dispatch_flags(namespace: str) -> tuple[str, str]:
    """(dispatch requested now, delayed dispatch timer): see :mod:`balancer.dispatch.trigger`."""
    t = tag(namespace)
    return t + DISPATCH_REQUESTED, t + DISPATCH_TIMER


def dispatch_round(namespace: str) -> tuple[str, str]:
    """(a run asked for, the run that holds the round): see :func:`balancer.dispatch.trigger.run_alone`."""
    t = tag(namespace)
    return t + DISPATCH_ASKED, t + DISPATCH_RUNNING


def beat_seen(namespace: str) -> str:
    """When beat's dispatch tick last ran (ms, string; expires when beat is gone):
    see :mod:`balancer.dispatch.fallback`."""
    return tag(namespace) + BEAT_SEEN


def consumers(namespace: str, name: str) -> str:
    """The worker processes consuming a model's queue (zset): consumer id -> until when (ms,
    Redis time), renewed by each worker's beat (:mod:`balancer.calls.consumers`); the
    dispatcher admits nothing to a model with none live (admit.lua, ``consumed`` in state.lua)."""
    return tag(namespace) + CONSUMERS_INFIX + name


def consumers_heard(namespace: str) -> str:
    """When Redis last heard any worker's beat, and when beats last resumed after a silence
    (hash: heard, resumed; ms, Redis time): whether lapsed records can be believed
    (:mod:`balancer.admission.liveness`)."""
    return tag(namespace) + CONSUMERS_HEARD


def source_read_errors(namespace: str) -> str:
    """Each source table's last failed read (hash): source name -> its error, removed when a read
    succeeds (see :mod:`balancer.sources.read_errors`)."""
    return tag(namespace) + SOURCE_READ_ERRORS


def live_calls(namespace: str) -> str:
    """The calls workers keep alive (zset): admission id -> until when (ms, Redis time),
    for the sweep (see :mod:`balancer.calls.heartbeat`)."""
    return tag(namespace) + LIVE_CALLS


def cancel_channel(namespace: str) -> str:
    """Pub/sub channel of calls to cut off: admission ids (see :mod:`balancer.calls.cancellation`)."""
    return tag(namespace) + CANCEL_CHANNEL


def cancelled_call(namespace: str, admission_id: str) -> str:
    """A call cancelled on the channel, kept a while (string, expiring): a call that was not yet
    listening when the cancel went out finds it here (see :mod:`balancer.calls.cancellation`)."""
    return tag(namespace) + CANCELLED_INFIX + admission_id


def router_admission(namespace: str, admission_id: str) -> str:
    """An admission the router issued (string: the core's admission id of its lease),
    expiring with the lease: ``/complete`` and ``/heartbeat`` act only on ids found here
    (see :mod:`balancer.router.admissions`)."""
    return tag(namespace) + ROUTER_ADMISSION_INFIX + admission_id


def router_idempotency(namespace: str, caller: str, key: str) -> str:
    """The answer to a ``/schedule`` sent by ``caller`` (its address) with this
    ``Idempotency-Key`` (JSON), until its admission is completed, for one lease at most:
    a retry from the same caller gets the same admission (see :mod:`balancer.router.admissions`)."""
    return tag(namespace) + ROUTER_IDEMPOTENCY_INFIX + caller + "|" + key


def broker_prefix(namespace: str) -> str:
    """kombu's ``global_keyprefix`` for this namespace's broker keys."""
    return namespace + ":"


#: kombu's Redis transport: the hash of messages delivered and not yet acknowledged.
BROKER_UNACKED = "unacked"


def broker_queue(namespace: str, queue: str) -> str:
    """The broker's list of a queue's waiting messages (kombu's Redis transport, priority 0).

    >>> broker_queue("prod", model_queue("gpt-a")), broker_unacked("prod")
    ('prod:model.gpt-a', 'prod:unacked')
    """
    return broker_prefix(namespace) + queue


def broker_unacked(namespace: str) -> str:
    """The broker's hash of delivered, unacknowledged messages: delivery tag -> [message, exchange, key]."""
    return broker_prefix(namespace) + BROKER_UNACKED


def fair_shares(namespace: str) -> str:
    """The fair share's state across dispatch rounds (hash): ``d:<source>`` -> deficit
    in tokens, ``last`` -> the source served last (see :mod:`balancer.sources.fairshare`)."""
    return tag(namespace) + FAIR_SHARES


def fair_shared(namespace: str) -> str:
    """Set (with an expiry) while several sources have shared the dispatch window recently:
    the ready lists stay shallow meanwhile (:data:`balancer.sources.fairshare.SHARED_READY_PER_SLOT`)."""
    return tag(namespace) + FAIR_SHARED


def last_failure(namespace: str, name: str) -> str:
    """A model's last failed call (JSON: when, its error, whether it was never sent, the model's
    answered count then), expiring; see :mod:`balancer.health.facts`."""
    return tag(namespace) + LAST_FAILURE_INFIX + name


def namespace_patterns(namespace: str) -> tuple[str, str]:
    """SCAN patterns matching every key of one namespace: admission state, broker."""
    return tag(namespace) + "*", broker_prefix(namespace) + "*"


#: Lua lines the script loader puts before the scripts' library (core.LIBRARY): the key layout, from this module.
LUA_PRELUDE = "\n".join(
    [
        "-- generated from balancer/admission/keys.py",
        f"local META_SUFFIX = '{META}'",
        f"local MODEL_INFIX = '{MODEL_INFIX}'",
        f"local INFLIGHT_INFIX = '{INFLIGHT_INFIX}'",
        f"local LATENCY_INFIX = '{LATENCY_INFIX}'",
        f"local STATS_INFIX = '{STATS_INFIX}'",
        f"local READY_INFIX = '{READY_INFIX}'",
        f"local WINDOW_INFIX = '{WINDOW_INFIX}'",
        f"local SYSTEM_STATS = '{SYSTEM_STATS}'",
        f"local CONSUMERS_INFIX = '{CONSUMERS_INFIX}'",
        f"local CONSUMERS_HEARD = '{CONSUMERS_HEARD}'",
        "",
    ]
)
