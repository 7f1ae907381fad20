"""How much of this process's CPUs other processes used while a start-up probe ran.

The GEMM probes (``kernels.capabilities``) time a C kernel against torch's and keep whichever
wins; timings taken while neighbours share the cores say little about the CPU. Four servers
starting at once on a 2-core Zen 4 EPYC measured the bfloat16 kernel at 1.02x torch's (idle:
1.7-2.3x), so that engine kept torch's GEMMs and lost its C decoder: 21 ms a token instead of 8
for as long as it ran. Replicas starting together on one node (a rollout, a scale-up) are the
same case.

Linux counts every CPU's busy time in ``/proc/stat`` (the node's, in a container); this
process's own CPU time (``time.process_time``, all its threads) subtracted from the busy time of
the CPUs it may run on leaves what the neighbours used, steal time included.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PROC_STAT = Path("/proc/stat")
# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal guest guest_nice.
# Busy is all but idle and iowait; guest time is already inside user and nice.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_seconds(cpus: set[int], stat: str | None = None) -> float | None:
    """The busy time of ``cpus`` since boot, in seconds, from ``/proc/stat`` (``stat``, its
    text, for tests); None where it cannot be read."""
    try:
        text = PROC_STAT.read_text() if stat is None else stat
    except OSError:
        return None
    ticks = 0
    for line in text.splitlines():
        name, _, fields = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = fields.split()
            ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks / os.sysconf("SC_CLK_TCK") if ticks else None


def neighbour_share(run: Callable[[], T]) -> tuple[T, float | None]:
    """``run()``'s result, and the share of this process's CPUs' time that other processes used
    while it ran (0: none, 1: all of it; None where ``/proc/stat`` cannot be read). The clock
    ticks are 10 ms, so a window of well under a second reads coarsely."""
    cpus = os.sched_getaffinity(0)
    busy_before, own_before = busy_seconds(cpus), time.process_time()
    started = time.perf_counter()
    result = run()
    wall = time.perf_counter() - started
    busy_after, own_after = busy_seconds(cpus), time.process_time()
    if busy_before is None or busy_after is None or wall <= 0:
        return result, None
    others = (busy_after - busy_before) - (own_after - own_before)
    return result, min(max(others / (wall * len(cpus)), 0.0), 1.0)
