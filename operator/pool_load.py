"""A pool's load for the autoscaler: its ready replicas' engine gauges plus the gateway's holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import httpx

from llmpool.load import Demand, parse_engine_gauges, replica_load
from llmpool.operator.fingerprints import DEFAULT_TIMEOUT_SECONDS, checkable, engine_url
from llmpool.operator.views import PodView

logger = logging.getLogger(__name__)


async def replica_loads(
    pods: Sequence[PodView],
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, float]:
    """Running plus waiting requests of each ready pod that answered its ``/metrics``."""
    targets = checkable(pods)
    async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:

        async def fetch(pod: PodView) -> float:
            assert pod.ip is not None
            response = await client.get(engine_url(pod.ip, "/metrics"))
            response.raise_for_status()
            gauges = parse_engine_gauges(response.text)
            return replica_load(gauges.get("running", 0.0), gauges.get("waiting", 0.0))

        results = await asyncio.gather(*(fetch(p) for p in targets), return_exceptions=True)
    loads = {}
    for pod, result in zip(targets, results, strict=True):
        if isinstance(result, BaseException):
            # Not counted: a replica that cannot answer is not serving either.
            logger.debug("GET /metrics of pod %s failed: %s", pod.name, result)
        else:
            loads[pod.name] = result
    return loads


def pool_demand(
    replicas: Mapping[str, float], annotations: Mapping[str, str] | None, now: float
) -> float:
    """What the pool must serve now: on its replicas plus held for it by a gateway."""
    demand = Demand.from_annotations(annotations)
    held = demand.held_at(now) if demand is not None else 0
    return sum(replicas.values()) + held
