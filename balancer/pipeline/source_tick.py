"""The source tables' part of beat's ingest tick: read every due source, then
write back every ended task waiting in the outbox."""

from __future__ import annotations

import logging

from balancer.pipeline.source_ingest import ingest_sources
from balancer.pipeline.source_writeback import drain
from balancer.services import Services

log = logging.getLogger(__name__)


def sources_tick(services: Services) -> int:
    """Ingest and write back; returns how many tasks were created."""
    reports = ingest_sources(services)
    created = sum(r.created for r in reports)
    if created:
        log.info("ingested %d task(s) from %s", created, ", ".join(r.source for r in reports if r.created))
    drained = drain(services)
    if drained.written or drained.conflicts:
        log.info("wrote back %d task(s); %d row(s) changed by someone else, not overwritten", drained.written,
                 drained.conflicts)
    return created
