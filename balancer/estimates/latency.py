"""Per-model latency, learned online: the sketch's buckets and how to read them.

Every finished call adds its latency to its model's sketch in Redis, in the
same round trip that frees its slot (``finish.lua``). The sketch is a fixed
set of log-spaced buckets, four per doubling from 50 ms (each about 19 % wide,
so a quantile read from it is at most 19 % above the true one), up to about
55 minutes. Counts are integers scaled by ``SAMPLE_WEIGHT`` and every sample
first decays the older ones by ``1/DECAY``: the sketch's memory halves about
every 44 calls, so it follows a model that slows down within a few dozen calls.

This module holds the pure half: which bucket a latency falls in (the caller
computes it, so the Lua does integer arithmetic only and the reference model
agrees with it to the unit), the quantiles read back from the counts, and the
corrections the drain ETA reads beside them (the sketch learns only from calls
that ended): a prior shrunk toward the first calls (:func:`early_mean_s`), and
Little's law over the calls in flight (:func:`observed_latency`).
Until a model has ``MIN_SAMPLES`` calls' worth of weight, its prior applies:
the quota's ``expected_latency_s``, else the global default
(``BALANCER_EXPECTED_LATENCY_S``), read as the median of a lognormal whose
p90 and p99 are ``PRIOR_P90`` and ``PRIOR_P99`` times it.

Why not condition on size: in this project's providers and simulator a call's
latency is drawn independently of its tokens, and the time per output token
cannot be known before the call (the output length is not). The sketch keeps
the decayed sums of prompt and completion tokens beside the latency so that
``quota list`` can show them and a conditioned model can be added if a
backend's latency turns out to follow size (docs/endgame.md).

>>> bucket_of(50), bucket_of(99), bucket_of(100), bucket_of(101), bucket_of(10**9)
(0, 4, 4, 5, 63)
>>> round(upper_ms(4))
100
>>> s = LatencySketch.from_samples([1_000] * 9 + [10_000])
>>> round(s.quantile_ms(0.5)), round(s.quantile_ms(0.95))   # the upper edges of 1 s and 10 s
(1131, 10763)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The lower edge of bucket 1 (bucket 0 holds everything below it).
FIRST_MS = 50
#: Buckets per doubling of latency.
PER_DOUBLING = 4
#: Number of buckets; the last holds everything from about 55 minutes up.
BUCKETS = 64
#: Weight of one sample in the counts (integer, so decay is exact in Lua and Python).
SAMPLE_WEIGHT = 1000
#: Each sample multiplies the older counts by (1 - 1/DECAY), with the floor.
DECAY = 64
#: Below this many samples' worth of weight, the prior applies.
MIN_SAMPLES = 5
#: The prior's p90, p99 and mean relative to its median (a lognormal with sigma 0.5),
#: and its dispersion E[L²]/E[L]² (exp(sigma²)).
PRIOR_P90 = 1.9
PRIOR_P99 = 3.2
PRIOR_MEAN = 1.133
PRIOR_DISPERSION = 1.284


def bucket_of(latency_ms: float) -> int:
    """The bucket a latency falls in: bucket i holds (upper_ms(i - 1), upper_ms(i)]."""
    if latency_ms <= FIRST_MS:
        return 0
    return min(BUCKETS - 1, math.ceil(PER_DOUBLING * math.log2(latency_ms / FIRST_MS)))


def upper_ms(bucket: int) -> float:
    """The upper edge of a bucket in ms (what a quantile in it reads as: the safe side)."""
    return FIRST_MS * 2 ** (bucket / PER_DOUBLING)


#: Each bucket's geometric middle in ms (what :meth:`LatencySketch.dispersion` reads it as).
_MIDDLES_MS = tuple(upper_ms(i) * 2 ** (-0.5 / PER_DOUBLING) for i in range(BUCKETS))


@dataclass(frozen=True)
class LatencyEstimate:
    """What the dispatcher plans with: p50, p90, p99 and mean in ms, and how many calls
    they come from (0: the prior). Without a mean, the prior's ratio to p50 applies;
    without a dispersion (E[L²]/E[L]²: 1 for a fixed latency), the prior's.

    >>> LatencyEstimate(1_000, 2_000, 3_000, 50).mean_ms
    1133.0
    """

    p50_ms: float
    p90_ms: float
    p99_ms: float
    samples: float
    mean_ms: float = 0.0
    dispersion: float = PRIOR_DISPERSION

    def __post_init__(self) -> None:
        if not self.mean_ms:
            object.__setattr__(self, "mean_ms", self.p50_ms * PRIOR_MEAN)

    @classmethod
    def prior(cls, median_s: float) -> LatencyEstimate:
        ms = median_s * 1000
        return cls(ms, ms * PRIOR_P90, ms * PRIOR_P99, 0.0)


@dataclass(frozen=True)
class LatencySketch:
    """A model's decayed latency histogram and token sums, as stored in Redis."""

    counts: tuple[int, ...] = (0,) * BUCKETS
    latency_ms_sum: int = 0
    prompt_tokens_sum: int = 0
    completion_tokens_sum: int = 0

    @classmethod
    def from_fields(cls, fields: Mapping[str, int]) -> LatencySketch:
        """From the Redis hash: ``b<i>`` bucket counts, ``ms``, ``pt``, ``ct`` sums."""
        counts = [0] * BUCKETS
        for key, value in fields.items():
            if key.startswith("b"):
                counts[int(key[1:])] = value
        return cls(tuple(counts), fields.get("ms", 0), fields.get("pt", 0), fields.get("ct", 0))

    @classmethod
    def from_samples(cls, latencies_ms: Iterable[float]) -> LatencySketch:
        """Undecayed, for tests and examples."""
        counts = [0] * BUCKETS
        for ms in latencies_ms:
            counts[bucket_of(ms)] += SAMPLE_WEIGHT
        return cls(tuple(counts))

    @property
    def samples(self) -> float:
        return sum(self.counts) / SAMPLE_WEIGHT

    def quantile_ms(self, q: float) -> float:
        """The upper edge of the bucket where the cumulative weight reaches ``q``."""
        total = sum(self.counts)
        if total == 0:
            return math.nan
        running = 0
        for i, count in enumerate(self.counts):
            running += count
            if running >= q * total:
                return upper_ms(i)
        return upper_ms(BUCKETS - 1)

    def dispersion(self) -> float:
        """E[L²]/E[L]² of the sketch's latencies (1 + the squared coefficient of
        variation), each bucket read at its geometric middle; 1 when it is empty.

        >>> LatencySketch.from_samples([1_000] * 10).dispersion()
        1.0
        >>> round(LatencySketch.from_samples([1_000] * 9 + [10_000]).dispersion(), 1)   # exactly 3.02
        2.9
        """
        total = sum(self.counts)
        if total == 0:
            return 1.0
        first = sum(c * x for c, x in zip(self.counts, _MIDDLES_MS, strict=True))
        second = sum(c * x * x for c, x in zip(self.counts, _MIDDLES_MS, strict=True))
        return second * total / (first * first)

    def estimate(self, prior_s: float) -> LatencyEstimate:
        """p50/p90/p99 from the sketch, or the prior until ``MIN_SAMPLES``.

        >>> LatencySketch().estimate(2.0).p90_ms
        3800.0
        >>> LatencySketch.from_samples([400] * 10).estimate(2.0).p50_ms < 500
        True
        """
        samples = self.samples
        if samples < MIN_SAMPLES:
            return LatencyEstimate.prior(prior_s)
        return LatencyEstimate(
            self.quantile_ms(0.5), self.quantile_ms(0.9), self.quantile_ms(0.99), samples,
            self.latency_ms_sum / samples, self.dispersion(),
        )


def early_mean_s(prior_mean_s: float, answered: float, answered_s: float, running: int = 0,
                 running_s: float = 0.0) -> float:
    """A model's mean latency (s) while it has fewer than ``MIN_SAMPLES`` calls measured:
    its prior weighs as ``MIN_SAMPLES`` calls at the prior's mean, beside the ``answered``
    calls (``answered_s`` seconds in all) and the ``running`` calls still in flight, each
    at the time it has run so far (``running_s`` in all: a call in flight for t s takes
    at least t s). The answered calls alone are the short ones (the long ones of the same
    start are still running), so the running ones weigh as lower bounds beside them.

    >>> early_mean_s(34.0, 0, 0.0)   # nothing seen: the prior
    34.0
    >>> round(early_mean_s(34.0, 2, 48.4, running=3, running_s=56.2), 2)   # (5 × 34 + 48.4 + 56.2) / 10
    27.46
    """
    return (MIN_SAMPLES * prior_mean_s + answered_s + running_s) / (MIN_SAMPLES + answered + running)


#: Fewer calls answered by a model in the window than this: its latency is not checked by Little's law;
#: beside Little's law, the sketch weighs as this many answers (:func:`observed_latency`).
MIN_MODEL_SOLVED = 10


def little_latency(in_flight: float, solved: int, window_s: float) -> float | None:
    """A model's mean latency by Little's law: it holds ``in_flight`` calls and
    answered ``solved`` in the last ``window_s`` s, so a call takes about
    in_flight × window_s / solved. None with too few answers.

    Unlike the latency sketch, which learns only from calls that ended (early
    on, the short ones: the long calls of a heavy tail are still running), this
    counts the calls still running too.

    >>> little_latency(16, 40, 60.0), little_latency(16, 5, 60.0), little_latency(16, 10, 4.0)   # 24 s a call
    (24.0, None, 6.4)
    """
    if solved < MIN_MODEL_SOLVED or in_flight <= 0 or window_s <= 0:
        return None
    return in_flight * window_s / solved


def observed_latency(sketch_s: float, little_s: float | None, solved: int) -> float:
    """A model's mean latency from its sketch's ``sketch_s`` and the :func:`little_latency`
    ``little_s`` of ``solved`` answers: raised toward Little's law when that is longer (the
    sketch's bias runs one way: short calls end first), by solved / (solved + MIN_MODEL_SOLVED).
    The few answers of a run's first seconds are a small sample of a heavy tail (a model's first
    9 answers read 7.2 s a call against its 5.1 s mean); 40 answers weigh 0.8, 90 weigh 0.9.

    >>> observed_latency(10.0, 24.0, 40), observed_latency(10.0, 24.0, 10), observed_latency(10.0, 6.0, 40)
    (21.2, 17.0, 10.0)
    >>> observed_latency(10.0, None, 0)
    10.0
    """
    if little_s is None or little_s <= sketch_s:
        return sketch_s
    return sketch_s + (little_s - sketch_s) * solved / (solved + MIN_MODEL_SOLVED)


def record(fields: dict[str, int], bucket: int, latency_ms: int, prompt_tokens: int, completion_tokens: int) -> None:
    """Add one call to a sketch's fields in place: decay every field, then add.

    This is the rule ``finish.lua`` applies (``record_latency`` in state.lua);
    the reference model calls this function, so the two are held equal by the
    differential tests.

    >>> f = {}
    >>> record(f, 4, 100, 10, 5); record(f, 4, 120, 10, 5)
    >>> f["b4"], f["ms"]
    (1985, 219)
    """
    for key in fields:
        fields[key] -= fields[key] // DECAY
    for key, add in ((f"b{bucket}", SAMPLE_WEIGHT), ("ms", latency_ms), ("pt", prompt_tokens), ("ct", completion_tokens)):
        fields[key] = fields.get(key, 0) + add
