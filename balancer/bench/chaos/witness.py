"""The chaos run's independent witness: pure maths over what the backend and PostgreSQL saw.

It never reads balancer's own counters. Its inputs are the simulated
backend's call log (every call it accepted or refused, with a key of the
prompt), the tasks' final rows, a log of every status and answer change that
a PostgreSQL trigger wrote (``WriteEvent``), the quota changes PostgreSQL
audited, the backend's own limits, and what the chaos run did (faults, kills,
processes that died). Times are Unix seconds.

>>> calls = [{"start": 0.0, "end": 1.0, "model": "m", "status": 200, "prompt_key": "k1", "counted": 10}]
>>> tasks = [TaskRow(1, "k1", "solved", None)]
>>> writes = [WriteEvent(1, "running", "solved", True, 1.1)]
>>> report = witness(calls, tasks, writes, expected_tasks=1, quota_caps={"m": [(0.0, 1)]}, provider={},
...                  faults=[], kills=[], deaths=[])
>>> report.passed, report.lost, report.double_written, report.repeats, report.overlaps
(True, 0, 0, [], [])
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from balancer.devtools.sim.audit import Limits, audit, calls_from_log

TERMINAL = ("solved", "failed", "cancelled")
#: A quota change reaches calls already admitted a moment later: a call is
#: checked against the largest cap in force during this many seconds before it.
QUOTA_SLACK_S = 1.0
#: The rate a fault's recovery must return to: this share of the pre-fault rate,
#: over a window of RATE_WINDOW_S, measured against the RATE_WINDOW_S * 3 before it.
RATE_SHARE = 0.8
RATE_WINDOW_S = 10.0
#: A request its worker wrote to the socket just before a ``kill -9`` reaches the backend after
#: it: a call the backend logs as started up to this long after its model's worker was killed is
#: that worker's (the model's next worker is restarted 0.5 s after the kill at the earliest).
IN_SOCKET_S = 0.2
#: Faults during which no answer can be written anywhere: the workers'
#: PostgreSQL stalled, every backend call refused, Redis down. Their time is
#: not counted in another fault's recovery: nothing can recover meanwhile.
BLOCKING = ("pg_stall", "backend_outage", "redis_restart")


@dataclass(frozen=True)
class TaskRow:
    id: int
    prompt_key: str
    status: str
    error: str | None


@dataclass(frozen=True)
class WriteEvent:
    task_id: int
    old_status: str | None
    new_status: str
    answer_written: bool  # the answer column changed to a value
    at: float


@dataclass(frozen=True)
class FaultWindow:
    label: str
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class Repeat:
    task_id: int
    model: str  # the model of the earlier paid call
    first_call: tuple[float, float]
    repeat_at: float
    explained_by: str | None  # the kill that was running it, or None


@dataclass(frozen=True)
class Overlap:
    task_id: int
    model: str
    first: tuple[float, float]
    second: tuple[float, float]
    explained_by: str | None


@dataclass(frozen=True)
class Recovery:
    fault: str
    first_answer_s: float | None  # from the fault's end to the first answer written after it
    rate_back_s: float | None  # from the fault's end until the pipeline was back (inf: never; None: no work left)
    blocked_s: float = 0.0  # of own_end_seconds, those when a BLOCKING fault was under way (progress impossible)

    @property
    def own_end_seconds(self) -> float | None:
        """Recovery counted from the fault's own end, whatever else was still broken then."""
        parts = [p for p in (self.first_answer_s, self.rate_back_s) if p is not None]
        return max(parts) if parts else None

    @property
    def seconds(self) -> float | None:
        """Recovery counted from the fault's end, less the time when a BLOCKING
        fault (its own overlapping neighbours) made any progress impossible."""
        own = self.own_end_seconds
        return None if own is None else max(0.0, own - self.blocked_s)


@dataclass
class WitnessReport:
    tasks: int
    expected_tasks: int
    ended: dict[str, int]
    lost: int
    ended_twice: list[int]
    failed_without_reason: list[int]
    double_written: int
    provider_violations: list[str]
    quota_breaches: list[str]
    repeats: list[Repeat]
    overlaps: list[Overlap]
    rate_limited: dict[str, int]
    recoveries: list[Recovery]
    deaths: list[str]
    calls_of_no_task: int
    notes: list[str] = field(default_factory=list)

    @property
    def unexplained_repeats(self) -> list[Repeat]:
        return [r for r in self.repeats if r.explained_by is None]

    @property
    def unexplained_overlaps(self) -> list[Overlap]:
        return [o for o in self.overlaps if o.explained_by is None]

    @property
    def recovery_p99(self) -> float | None:
        """p99 of :attr:`Recovery.seconds` (from when the pipeline could work again)."""
        return _p99([r.seconds for r in self.recoveries if r.first_answer_s is not None or r.rate_back_s is not None])

    @property
    def own_end_recovery_p99(self) -> float | None:
        """p99 of :attr:`Recovery.own_end_seconds` (from each fault's own end; for information)."""
        return _p99([r.own_end_seconds for r in self.recoveries
                     if r.first_answer_s is not None or r.rate_back_s is not None])

    @property
    def passed(self) -> bool:
        p99 = self.recovery_p99
        return (self.lost == 0 and not self.ended_twice and self.double_written == 0 and not self.provider_violations
                and not self.quota_breaches and not self.unexplained_repeats and not self.unexplained_overlaps
                and not self.deaths
                and self.tasks == self.expected_tasks and (p99 is None or p99 <= 60.0))


def _p99(seconds: Sequence[float | None]) -> float | None:
    # A fault after which nothing was left to do has nothing to recover (not counted).
    values = sorted(v if v is not None else float("inf") for v in seconds)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, -(-99 * len(values) // 100) - 1))]


def blocked_within(start: float, end: float, faults: Sequence[FaultWindow]) -> float:
    """Seconds of [start, end] during which a BLOCKING fault was under way
    (overlapping ones counted once).

    >>> w = [FaultWindow("a", "pg_stall", 0, 10), FaultWindow("b", "backend_outage", 8, 20),
    ...      FaultWindow("c", "kill_beat", 0, 30), FaultWindow("d", "pg_stall", 25, 40)]
    >>> blocked_within(5, 30, w), blocked_within(20, 25, w), blocked_within(0, float("inf"), w)
    (20.0, 0.0, 35.0)
    """
    spans = sorted((max(start, f.start), min(end, f.end)) for f in faults if f.kind in BLOCKING)
    total, reached = 0.0, start
    for a, b in spans:
        a = max(a, reached)
        if b > a:
            total, reached = total + (b - a), b
    return total


def _ends(writes: Sequence[WriteEvent]) -> dict[int, int]:
    ends: dict[int, int] = {}
    for w in writes:
        if w.new_status in TERMINAL and w.old_status not in TERMINAL:
            ends[w.task_id] = ends.get(w.task_id, 0) + 1
    return ends


def quota_breaches(calls: Sequence[Mapping[str, Any]], caps: Mapping[str, Sequence[tuple[float, int | None]]]) -> list[str]:
    """Accepted calls that started with more calls in flight on their model than any
    concurrency cap in force during the QUOTA_SLACK_S before (a removed model: 0)."""
    out = []
    by_model: dict[str, list[tuple[float, float]]] = {}
    for c in calls:
        if c["status"] != 429 and not c.get("injected"):
            by_model.setdefault(c["model"], []).append((c["start"], c["end"]))
    for model, spans in sorted(by_model.items()):
        timeline = sorted(caps.get(model, ()), key=lambda t: t[0])
        if not timeline:
            continue
        times = [t for t, _ in timeline]
        spans.sort()
        ends: list[float] = []  # a min-heap would do; sorted insertion keeps it simple and exact
        for start, end in spans:
            cut = bisect.bisect_right(ends, start)
            del ends[:cut]
            bisect.insort(ends, end)
            level = len(ends)
            first = max(0, bisect.bisect_right(times, start - QUOTA_SLACK_S) - 1)
            last = bisect.bisect_right(times, start) - 1
            allowed = max(((timeline[i][1] or 0) for i in range(first, last + 1)), default=0)
            if level > allowed:
                out.append(f"{model}: {level} in flight > cap {allowed} at t={start:.3f}")
    return out


def repeated_calls(calls: Sequence[Mapping[str, Any]], task_of: Mapping[str, int],
                   kills: Sequence[tuple[str, float]],
                   answers_written: Mapping[int, Sequence[float]] | None = None) -> tuple[list[Repeat], int]:
    """Every answered call beyond a task's first, and whether a kill of the worker
    running the earlier call explains it (a kill up to IN_SOCKET_S before the backend
    logged the call's start: its request was already sent); plus how many answered calls belong
    to no task.

    A worker's call lives from its start to its answer's durable write (see
    balancer.calls.call): a kill after the backend answered but before the
    answer was written (``answers_written``: the times each task's answer was
    written) loses the paid answer with the worker, and explains the repeat as
    a kill during the call does. A kill after the write, or after the repeat
    began, explains nothing; without ``answers_written`` only a kill during
    the call explains."""
    written = {task: sorted(times) for task, times in (answers_written or {}).items()}
    kill_times: dict[str, list[float]] = {}
    for name, at in kills:
        kill_times.setdefault(name, []).append(at)
    for times in kill_times.values():
        times.sort()
    answered: dict[int, list[Mapping[str, Any]]] = {}
    orphans = 0
    for c in calls:
        if c["status"] != 200:
            continue
        task = task_of.get(c.get("prompt_key", ""))
        if task is None:
            orphans += 1
            continue
        answered.setdefault(task, []).append(c)
    repeats = []
    for task, own in sorted(answered.items()):
        own.sort(key=lambda c: c["start"])
        for i, later in enumerate(own[1:], start=1):
            explained = None
            for earlier in own[:i]:
                times = kill_times.get(f"worker-{earlier['model']}", [])
                task_writes = written.get(task, [])
                w = bisect.bisect_left(task_writes, earlier["end"])
                held_until = min(later["start"], task_writes[w] if w < len(task_writes) else later["start"])
                j = bisect.bisect_left(times, earlier["start"] - IN_SOCKET_S)
                if j < len(times) and times[j] <= earlier["end"]:
                    explained = f"worker-{earlier['model']} killed at {times[j]:.3f}"
                    break
                if answers_written is not None and j < len(times) and times[j] < held_until:
                    explained = f"worker-{earlier['model']} killed at {times[j]:.3f}, its answer not yet written"
                    break
            first = own[0]
            repeats.append(Repeat(task, first["model"], (first["start"], first["end"]), later["start"], explained))
    return repeats, orphans


def _kill_during(kill_times: Mapping[str, list[float]], model: str, start: float, end: float) -> str | None:
    times = kill_times.get(f"worker-{model}", [])
    j = bisect.bisect_left(times, start - IN_SOCKET_S)
    return f"worker-{model} killed at {times[j]:.3f}" if j < len(times) and times[j] <= end else None


def overlapping_calls(calls: Sequence[Mapping[str, Any]], task_of: Mapping[str, int],
                      kills: Sequence[tuple[str, float]]) -> list[Overlap]:
    """Two accepted calls of one task running at once (whatever they answered), each
    explained only by a kill of the worker that ran the earlier one, during it (IN_SOCKET_S)."""
    kill_times: dict[str, list[float]] = {}
    for name, at in sorted(kills, key=lambda k: k[1]):
        kill_times.setdefault(name, []).append(at)
    by_task: dict[int, list[Mapping[str, Any]]] = {}
    for c in calls:
        task = task_of.get(c.get("prompt_key", ""))
        if c["status"] != 429 and task is not None:
            by_task.setdefault(task, []).append(c)
    out = []
    for task, own in sorted(by_task.items()):
        own.sort(key=lambda c: c["start"])
        for i, later in enumerate(own[1:], start=1):
            for earlier in own[:i]:
                if later["start"] < earlier["end"]:
                    out.append(Overlap(task, earlier["model"], (earlier["start"], earlier["end"]),
                                       (later["start"], later["end"]),
                                       _kill_during(kill_times, earlier["model"], earlier["start"], later["start"])))
    return out


def recoveries(faults: Sequence[FaultWindow], answers: Sequence[float], last_answer: float,
               opened: Sequence[float] = (), closed: Sequence[float] = ()) -> list[Recovery]:
    """Per fault: the first answer after its end, how much of its recovery
    BLOCKING faults took up (other faults under way after its end), and when
    the pipeline was back:
    the answer rate over RATE_WINDOW_S at RATE_SHARE of the rate before the fault
    began, or its backlog (tasks stored and not ended; ``opened``/``closed`` are
    those times) no larger than when the fault began. A pipeline that keeps up
    with its arrivals answers at their rate, not at its pre-fault one. Both are
    checked each second from the fault's end (or its first answer) until the last
    answer or the last task's end, whichever is later, and at least once: a fault
    ending after them is back if its backlog then is no larger than at its start."""
    answers, opened, closed = sorted(answers), sorted(opened), sorted(closed)
    settled = max(last_answer, closed[-1] if closed else last_answer)  # after it, nothing changes

    def backlog(t: float) -> int:
        return bisect.bisect_right(opened, t) - bisect.bisect_right(closed, t)

    out = []
    for f in faults:
        i = bisect.bisect_right(answers, f.end)
        first = answers[i] - f.end if i < len(answers) else None
        before = bisect.bisect_left(answers, f.start) - bisect.bisect_left(answers, f.start - 3 * RATE_WINDOW_S)
        target = RATE_SHARE * before / 3  # answers per RATE_WINDOW_S
        start_backlog = backlog(f.start) if opened else -1
        back: float | None = None
        if first is None and opened and backlog(f.end) == 0:
            out.append(Recovery(f.label, None, None))  # nothing was left to do after it
            continue
        t = f.end if first is None else answers[i]  # not back before the first answer
        while True:  # each second from t, the last answer and the last end too, and t at least
            done = bisect.bisect_left(answers, t + RATE_WINDOW_S) - bisect.bisect_left(answers, t)
            if done >= target or backlog(t) <= start_backlog:
                back = t - f.end
                break
            if t >= settled:
                break
            t = min(p for p in (t + 1.0, last_answer, settled) if p > t)
        if back is None:
            back = 0.0 if target == 0 else float("inf")  # work remained and the pipeline never caught up
        own = max(p for p in (first, back) if p is not None)
        out.append(Recovery(f.label, first, back, blocked_within(f.end, f.end + own, faults) if own < float("inf") else 0.0))
    return out


def witness(
    calls: Sequence[Mapping[str, Any]],
    tasks: Sequence[TaskRow],
    writes: Sequence[WriteEvent],
    *,
    expected_tasks: int,
    quota_caps: Mapping[str, Sequence[tuple[float, int | None]]],
    provider: Mapping[str, Limits],
    faults: Sequence[FaultWindow],
    kills: Sequence[tuple[str, float]],
    deaths: Sequence[str],
) -> WitnessReport:
    ended: dict[str, int] = {}
    for t in tasks:
        ended[t.status] = ended.get(t.status, 0) + 1
    ends = _ends(writes)
    lost = sum(1 for t in tasks if t.status not in TERMINAL)
    twice = sorted(task for task, n in ends.items() if n > 1)
    no_reason = [t.id for t in tasks if t.status == "failed" and not (t.error or "").strip()]
    written: dict[int, int] = {}
    for w in writes:
        if w.answer_written:
            written[w.task_id] = written.get(w.task_id, 0) + 1
    double = sum(n - 1 for n in written.values() if n > 1)
    violations = [str(v) for v in audit(calls_from_log([c for c in calls if not c.get("injected")]), provider)]
    refused: dict[str, int] = {}
    for c in calls:
        if c["status"] == 429:
            kind = "injected" if c.get("injected") else str(c.get("limit") or "unknown")
            refused[kind] = refused.get(kind, 0) + 1
    task_of = {t.prompt_key: t.id for t in tasks}
    answers_written: dict[int, list[float]] = {}
    for w in writes:
        if w.answer_written:
            answers_written.setdefault(w.task_id, []).append(w.at)
    repeats, orphans = repeated_calls(calls, task_of, kills, answers_written)
    overlaps = overlapping_calls(calls, task_of, kills)
    answers = [w.at for w in writes if w.new_status == "solved" and w.old_status != "solved"]
    last = max(answers, default=0.0)
    opened = [w.at for w in writes if w.old_status is None]
    closed = [w.at for w in writes if w.new_status in TERMINAL and w.old_status not in TERMINAL]
    return WitnessReport(
        tasks=len(tasks), expected_tasks=expected_tasks, ended=ended, lost=lost + max(0, expected_tasks - len(tasks)),
        ended_twice=twice, failed_without_reason=no_reason, double_written=double, provider_violations=violations,
        quota_breaches=quota_breaches(calls, quota_caps), repeats=repeats, overlaps=overlaps, rate_limited=refused,
        recoveries=recoveries(faults, answers, last, opened, closed), deaths=list(deaths), calls_of_no_task=orphans,
    )
