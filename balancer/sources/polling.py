"""Source tables read off the dispatch path: each source on a thread of its own.

The team's database is someone else's: a migration holding ``LOCK TABLE ...
ACCESS EXCLUSIVE`` for a minute, a ``where`` that is slow, or a database that
stops answering must delay that source's own rows and nothing else. So the
dispatcher's control threads never read a source table (they dispatch, sweep
and read the inbox); :class:`SourceReadLoop` polls, in every dispatcher process,
on a thread of its own, and :class:`SourcePoller` starts one reader thread per
due source, never a second one for a source whose read has not ended. Each read
runs within the source's time limits (:class:`balancer.sources.catalog.TimeLimits`):
a table locked by the team fails its read after ``BALANCER_SOURCE_LOCK_TIMEOUT``
and the source is read again at its next turn. Two dispatchers reading one
source at once insert each row once (:mod:`balancer.sources.ingest`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from celery import bootsteps

from balancer.admission import keys
from balancer.services import Services
from balancer.settings import Settings
from balancer.sources.definition import SourceDef
from balancer.sources.ingest import due_sources, ingest_logged, quota_bursts

log = logging.getLogger(__name__)


class SourcePoller:
    """Starts a reader thread for each due source that has none running; ``created``
    is called (on the reader's thread) when a read made tasks."""

    def __init__(self, services: Services, created: Callable[[], None] = lambda: None) -> None:
        self.services = services
        self._created = created
        self._readers: dict[str, threading.Thread] = {}

    def poll(self) -> list[str]:
        """One turn: the names of the sources whose reads it started."""
        self._readers = {name: t for name, t in self._readers.items() if t.is_alive()}
        due = [d for d in due_sources(self.services) if d.name not in self._readers]
        if not due:
            return []
        models = quota_bursts(self.services)
        for definition in due:
            reader = threading.Thread(target=self._read, args=(definition, models), daemon=True,
                                      name=f"source-read-{definition.name}")
            self._readers[definition.name] = reader
            reader.start()
        return [d.name for d in due]

    def reading(self) -> list[str]:
        """The sources whose read has not ended (a locked or slow table's among them)."""
        return sorted(name for name, t in self._readers.items() if t.is_alive())

    def join(self, timeout: float | None = None) -> None:
        for reader in list(self._readers.values()):
            reader.join(timeout)

    def _read(self, definition: SourceDef, models: dict[str, int]) -> None:
        report = ingest_logged(self.services, definition, models)
        if report is not None and report.created:
            try:
                self._created()
            except Exception as exc:  # noqa: BLE001 - the next dispatch tick takes the tasks all the same
                log.warning("source %s: could not ask for a dispatch: %s", definition.name, exc)


class SourceReadLoop(bootsteps.StartStopStep):
    """In the dispatcher: :meth:`SourcePoller.poll` every ``BALANCER_INGEST_TICK``, on a thread
    of its own. A subclass gives :meth:`created` (the pipeline asks for a dispatch)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()

    def created(self) -> None:
        """A read made tasks."""

    def start(self, consumer) -> None:  # noqa: ANN001
        if keys.CONTROL_QUEUE not in {q.name for q in consumer.task_consumer.queues}:
            return  # a model worker
        self._stop.clear()
        threading.Thread(target=self._run, name="source-poll", daemon=True).start()

    def stop(self, consumer) -> None:  # noqa: ANN001
        self._stop.set()

    def _run(self) -> None:
        # Connected here, not through balancer.calls.runtime: the sources room sits below the pipeline.
        svc = Services.connect(Settings.from_env(), check=False)
        poller = SourcePoller(svc, self.created)
        tick = svc.settings.ingest_tick
        while not self._stop.wait(tick):
            try:
                poller.poll()
            except Exception as exc:  # noqa: BLE001 - keep going through a PostgreSQL blip
                log.warning("source tables not polled this tick: %s", str(exc).splitlines()[0] if str(exc) else exc)
