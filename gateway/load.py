"""How loaded each replica and pool is: engine gauges scraped on a period plus requests counted here.

The signal itself (which gauges, what a replica's load is) is defined in ``llmpool.load``, shared
with the operator's autoscaler.

The scrape sees every gateway replica's traffic but is up to one period old; the local in-flight
count is exact for this gateway at routing time, so a burst never piles onto the replica that
looked idle at the last scrape. A replica's load is the larger of the two. What the gateway
holds for a pool goes to the operator's autoscaler through ``llmpool.gateway.demand``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from llmpool.gateway.pools import Pool, PoolKey, PoolTable, Replica
from llmpool.load import parse_engine_gauges, replica_load

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaLoad:
    in_flight: int = 0  # requests this gateway sent and has not seen finish
    running: float = 0.0  # last scrape
    waiting: float = 0.0  # last scrape
    kv_cache_usage: float = 0.0  # last scrape, 0..1
    digest: str | None = None  # the replica's /fingerprint digest; None until known
    # The adapters its /fingerprint lists, name -> digest of their files; None until known
    adapters: Mapping[str, str] | None = None

    @property
    def load(self) -> float:
        """Requests on the replica: the scrape counts ours too, so the larger of the two."""
        return max(float(self.in_flight), replica_load(self.running, self.waiting))


class LoadTracker:
    """Per-replica load, updated by routing (in-flight) and by the scraper (gauges, fingerprint).

    ``wait_for_fingerprints`` lets a request held for an adapter wake up when a replica's
    fingerprint changes (the adapter may have just been loaded there).
    """

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaLoad] = {}
        self._held: Counter[PoolKey] = Counter()
        self._fingerprints_changed = asyncio.Event()

    def get(self, replica: Replica) -> ReplicaLoad:
        return self._replicas.get(replica.url, ReplicaLoad())

    def _update(self, replica: Replica, **changes: Any) -> None:
        self._replicas[replica.url] = replace(self.get(replica), **changes)

    def begin(self, replica: Replica) -> None:
        """A request was sent to ``replica``; ``end`` when its response is over, however it ends."""
        self._update(replica, in_flight=self.get(replica).in_flight + 1)

    def end(self, replica: Replica) -> None:
        self._update(replica, in_flight=self.get(replica).in_flight - 1)

    @contextlib.contextmanager
    def held(self, pool: Pool) -> Iterator[None]:
        self._held[pool.key] += 1
        try:
            yield
        finally:
            self._held[pool.key] -= 1

    def replicas(self) -> dict[str, ReplicaLoad]:
        """Every tracked replica's load, by URL."""
        return dict(self._replicas)

    def held_count(self, pool: Pool) -> int:
        return self._held[pool.key]

    def record_scrape(self, replica: Replica, gauges: dict[str, float]) -> None:
        self._update(replica, **gauges)

    def record_fingerprint(
        self, replica: Replica, digest: str | None, adapters: Mapping[str, str]
    ) -> None:
        known = self.get(replica)
        if (known.digest, known.adapters) == (digest, adapters):
            return
        self._update(replica, digest=digest, adapters=adapters)
        self._fingerprints_changed.set()
        self._fingerprints_changed = asyncio.Event()

    def wait_for_fingerprints(self) -> Coroutine[Any, Any, bool]:
        """Done at the next change after this call (the event is taken now, not when awaited)."""
        return self._fingerprints_changed.wait()

    def forget_except(self, replicas: Sequence[Replica]) -> None:
        """Drop replicas that left every pool, unless requests to them are still running."""
        keep = {r.url for r in replicas}
        self._replicas = {
            url: load for url, load in self._replicas.items() if url in keep or load.in_flight > 0
        }


async def scrape_replica(client: httpx.AsyncClient, tracker: LoadTracker, replica: Replica) -> None:
    """Gauges from /metrics, the digest and the adapters from /fingerprint; a failure keeps the
    last values."""
    try:
        metrics = await client.get(f"{replica.url}/metrics")
        metrics.raise_for_status()
        tracker.record_scrape(replica, parse_engine_gauges(metrics.text))
        fingerprint = await client.get(f"{replica.url}/fingerprint")
        fingerprint.raise_for_status()
        body = fingerprint.json()
        digest = body.get("digest")
        adapters = fingerprint_adapters(body)
        tracker.record_fingerprint(replica, digest if isinstance(digest, str) else None, adapters)
    except (httpx.HTTPError, ValueError, AttributeError) as error:
        logger.debug("scrape of %s failed: %s", replica.url, error)


def fingerprint_adapters(fingerprint: Mapping[str, Any]) -> dict[str, str]:
    """Name -> digest of the adapters a /fingerprint lists as loaded (none without LoRA)."""
    return {
        entry["name"]: entry["digest"]
        for entry in fingerprint.get("adapters") or []
        if isinstance(entry, Mapping)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("digest"), str)
    }


async def scrape_forever(
    table: PoolTable, tracker: LoadTracker, client: httpx.AsyncClient, interval: float
) -> None:
    while True:
        replicas = table.all_replicas()
        tracker.forget_except(replicas)
        await asyncio.gather(*(scrape_replica(client, tracker, r) for r in replicas))
        await asyncio.sleep(interval)
