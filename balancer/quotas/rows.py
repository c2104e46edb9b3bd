"""The stored quotas, read without SQLAlchemy (``status`` reads them on its snapshot;
:class:`balancer.quotas.store.QuotaStore` reads and writes them with it): a row of
``quotas`` is a :class:`~balancer.admission.quota.Quota`, its columns the dataclass's fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from balancer.admission.quota import Quota
from balancer.storage.rows import RowSource, fetch

#: The columns a quota is read from, in order: every field of :class:`Quota` (the table's other column is ``updated_at``).
QUOTA_COLUMNS = tuple(f.name for f in dataclasses.fields(Quota))
_ALL_QUOTAS = f"SELECT {', '.join(QUOTA_COLUMNS)} FROM quotas ORDER BY name"  # noqa: S608 - the field names above, never input


def quota_from_row(row: Sequence[Any]) -> Quota:
    """The quota of a row holding :data:`QUOTA_COLUMNS`, in order."""
    return Quota(**dict(zip(QUOTA_COLUMNS, row, strict=True)))


def all_quotas(db: RowSource) -> list[Quota]:
    """Every stored quota, by name."""
    return [quota_from_row(row) for row in fetch(db, _ALL_QUOTAS)]
