"""Pure SVG geometry for the console's charts: sparklines and the drain's burn-down.

No I/O and no markup: each function returns the numbers a template draws
(``points`` attributes of a polyline, axis labels), so autoescaping stays on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def sparkline(values: Sequence[float], width: float = 120, height: float = 24, *, floor: float | None = 0.0) -> str:
    """The ``points`` of a polyline drawing ``values`` left to right in a ``width`` x ``height`` box.

    The y axis runs from ``floor`` (or the smallest value, if lower or None) to
    the largest; an all-zero series sits on the bottom edge.

    >>> sparkline([0, 5, 10], width=100, height=10)
    '0,10 50,5 100,0'
    >>> sparkline([3], width=100, height=10), sparkline([0, 0], width=100, height=10)
    ('0,0 100,0', '0,10 100,10')
    >>> sparkline([])
    ''
    """
    if not values:
        return ""
    if len(values) == 1:
        values = [values[0], values[0]]
    low = min(values) if floor is None else min(floor, min(values))
    span = max(values) - low
    step = width / (len(values) - 1)
    points = []
    for i, v in enumerate(values):
        y = height - (height * (v - low) / span if span > 0 else 0.0)
        points.append(f"{_num(i * step)},{_num(y)}")
    return " ".join(points)


@dataclass(frozen=True)
class BurnDown:
    """A burn-down chart's geometry: the tasks left as seen, and the ETA's projection."""

    width: float
    height: float
    seen: str  # polyline points: tasks left at each sample
    projection: str  # polyline points: from the last sample to zero at the ETA ("" if unknown)
    top: int  # the y axis' top value (tasks)
    span_s: float  # seconds the x axis covers
    band: str = ""  # polygon points: from the last sample to zero anywhere between the ETA's low and high ("" if none)


def burn_down(samples: Sequence[tuple[float, int]], eta_s: float | None, width: float = 600, height: float = 200,
              band: tuple[float | None, float | None] = (None, None)) -> BurnDown:
    """Tasks left over time (``(seconds, tasks left)`` samples, oldest first) and,
    from the last sample, a straight line to zero at ``eta_s`` seconds later, in
    a shaded triangle to zero between the ETA's ``band`` (low, high seconds).

    >>> b = burn_down([(0, 100), (10, 80)], eta_s=40, width=50, height=100)
    >>> b.seen, b.projection, b.top, b.span_s, b.band
    ('0,0 10,20', '10,20 50,100', 100, 50, '')
    >>> b = burn_down([(0, 100), (10, 80)], eta_s=30, width=60, height=100, band=(20, 50))
    >>> b.projection, b.band, b.span_s
    ('10,20 40,100', '10,20 30,100 60,100', 60)
    >>> burn_down([(0, 10)], eta_s=None, width=50, height=100).projection
    ''
    """
    if not samples:
        return BurnDown(width, height, "", "", 0, 0.0)
    start, end = samples[0][0], samples[-1][0]
    last = samples[-1][1]
    live = eta_s is not None and eta_s > 0 and last > 0
    low, high = band
    banded = live and low is not None and high is not None
    horizon = end + (max(eta_s or 0.0, high or 0.0) if banded else eta_s or 0.0 if live else 0.0)
    span = max(horizon - start, 1e-9)
    top = max(1, max(n for _, n in samples))

    def point(t: float, n: float) -> str:
        return f"{_num((t - start) / span * width)},{_num(height - n / top * height)}"

    seen = " ".join(point(t, n) for t, n in samples)
    projection = f"{point(end, last)} {point(end + (eta_s or 0.0), 0)}" if live else ""
    shade = f"{point(end, last)} {point(end + (low or 0.0), 0)} {point(end + (high or 0.0), 0)}" if banded else ""
    return BurnDown(width, height, seen, projection, top, round(horizon - start, 3), shade)


def _num(x: float) -> str:
    """A coordinate, short: at most one decimal.

    >>> _num(10.0), _num(3.14159)
    ('10', '3.1')
    """
    return f"{round(x, 1):g}"
