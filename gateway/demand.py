"""What this gateway holds for each pool, written where the operator's autoscaler reads it.

A pool with no ready replica (scaled to zero, or all replicas down) gets its requests held here;
the operator cannot see them in any engine's gauges, so the gateway records the count in the
status of the pool's LLMPoolDemand (``llmpool.load.Demand``), under this replica's own name: the
records of several gateway replicas stand side by side and the operator adds them up. The
gateway may patch only that status, never an LLMPool. Writes are rate-limited: the first hold
is written at once (a pool at zero scales up from it), then the record is refreshed every
``DEMAND_REFRESH_SECONDS`` while requests are held, and cleared once when none are.

A count is taken as demand only if as many requests were held ``SETTLE_SECONDS`` earlier too:
a client that sends and hangs up (fire and forget) is dropped within milliseconds of its hold,
so a burst of them never reaches the autoscaler and leaves the pool at its minimum.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from llmpool.gateway.load import LoadTracker
from llmpool.gateway.pools import PoolKey, PoolTable
from llmpool.load import DEMAND_GATEWAYS_FIELD, DEMAND_REFRESH_SECONDS, Demand
from llmpool.operator import kube, naming

logger = logging.getLogger(__name__)

DemandWriter = Callable[[PoolKey, Demand], Awaitable[None]]
CHECK_SECONDS = 1.0  # how often held counts are compared with what was last written
SETTLE_SECONDS = 0.5  # a count must hold this long to be demand


class DemandReporter:
    def __init__(
        self,
        table: PoolTable,
        tracker: LoadTracker,
        write: DemandWriter,
        refresh: float = DEMAND_REFRESH_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.table = table
        self.tracker = tracker
        self.write = write
        self.refresh = refresh
        self.clock = clock
        self._written: dict[PoolKey, Demand] = {}
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """A request was just held: report without waiting for the next check."""
        self._wake.set()

    def held_counts(self) -> dict[PoolKey, int]:
        return {pool.key: self.tracker.held_count(pool) for pool in self.table.pools()}

    def due(self, earlier: dict[PoolKey, int] | None = None) -> list[tuple[PoolKey, Demand]]:
        """The records to write now; each is taken as written (a failed write is retried later).
        ``earlier``: the held counts ``SETTLE_SECONDS`` ago; only what was held then too counts."""
        now = self.clock()
        writes = []
        for pool in self.table.pools():
            held = self.tracker.held_count(pool)
            if earlier is not None:
                held = min(held, earlier.get(pool.key, 0))
            last = self._written.get(pool.key)
            last_held = last.held if last else 0
            stale = last is None or now - last.at >= self.refresh
            if (held > 0 and (last_held == 0 or stale)) or (held == 0 and last_held > 0):
                writes.append((pool.key, Demand(held=held, at=now)))
        return writes

    async def run(self) -> None:
        """Runs until cancelled (the app's lifespan ends)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CHECK_SECONDS)
            self._wake.clear()
            earlier = self.held_counts()
            await asyncio.sleep(SETTLE_SECONDS)
            for key, demand in self.due(earlier):
                try:
                    await self.write(key, demand)
                except Exception as error:  # a hint, not a request: log it and try again later
                    logger.warning("recording demand of LLMPool %s/%s failed: %s", *key, error)
                    continue
                self._written[key] = demand


def demand_recorder(replica: str) -> DemandWriter:
    """The writer used in a cluster: a merge patch of this replica's record in the status of the
    pool's LLMPoolDemand (``replica``: this gateway's pod name)."""

    async def record(key: PoolKey, demand: Demand) -> None:
        patch = {DEMAND_GATEWAYS_FIELD: {replica: demand.to_record()}}
        await kube.patch_demand_status(key[0], naming.demand_name(key[1]), patch)

    return record
