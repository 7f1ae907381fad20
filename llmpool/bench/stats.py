"""The one definition of a latency percentile every benchmark reports.

``percentile(values, 95)`` is numpy's default (linear interpolation between the two nearest
ranks): the value at rank ``0.95 * (n - 1)`` of the sorted samples, interpolated. It is what
``llmpool bench serve`` has always reported. Result files written before 2026-12 by
``benchmarks/priority_itl.py``, ``server_overhead.py`` (nearest rank ``round(q * (n - 1))``) and
``gateway_routing.py`` (``int(q * n)``, one rank higher) used nearest-rank definitions instead;
on their sample sizes the two differ by at most one sample's gap.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of ``values``, interpolated linearly; NaN when empty."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), p))


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean and p50/p95/p99, scaled (seconds to milliseconds by default); NaN when empty."""
    scaled = [value * scale for value in values]
    mean = float(np.mean(scaled)) if scaled else math.nan
    return {"mean": mean, **{f"p{p}": percentile(scaled, p) for p in PERCENTILES}}


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``run``, after one call to warm it up."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
