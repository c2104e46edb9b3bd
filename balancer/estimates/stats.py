"""Small statistics shared by the router's advice and the bench reports (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 100]; None for no values.

    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 99), percentile([], 50)
    (2, 4, None)
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
