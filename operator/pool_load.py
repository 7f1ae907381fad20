"""A pool's load: its ready replicas' engine gauges plus the gateway's holds (for the autoscaler),
and the deletion cost that makes a scale-down remove the least-loaded replica."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import httpx

from llmpool.load import Demand, held_for_pool, parse_engine_gauges, replica_load
from llmpool.operator.fingerprints import DEFAULT_TIMEOUT_SECONDS, fetch_from_pods
from llmpool.operator.views import PodView

logger = logging.getLogger(__name__)


def _in_flight(pod: PodView, response: httpx.Response) -> float:
    gauges = parse_engine_gauges(response.text)
    return replica_load(gauges.get("running", 0.0), gauges.get("waiting", 0.0))


async def replica_loads(
    pods: Sequence[PodView],
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, float]:
    """Running plus waiting requests of each ready pod that answered its ``/metrics``.

    A pod that does not answer is left out: a replica that cannot answer is not serving either.
    """
    loads, failed = await fetch_from_pods(
        pods, "/metrics", _in_flight, timeout=timeout, transport=transport
    )
    for pod, why in failed.items():
        logger.debug("GET /metrics of pod %s failed: %s", pod, why)
    return loads


def pool_demand(replicas: Mapping[str, float], gateways: Mapping[str, Demand], now: float) -> float:
    """What the pool must serve now: on its replicas plus held for it by the gateways (each
    gateway replica's fresh record, ``llmpool.load.held_for_pool``)."""
    return sum(replicas.values()) + held_for_pool(gateways, now)


def deletion_costs(pods: Sequence[PodView], loads: Mapping[str, float]) -> dict[str, str]:
    """The ``pod-deletion-cost`` to write on each pod whose annotation is out of step with its
    load, so that the ReplicaSet's scale-down removes idle replicas before busy ones.

    A pod's cost is the requests it holds (rounded); a pod that did not answer its ``/metrics``
    keeps what it has (one that is not Ready the ReplicaSet removes first anyway).
    """
    return {
        pod.name: cost
        for pod in pods
        if pod.name in loads
        and not pod.terminating
        and (cost := str(round(loads[pod.name]))) != pod.deletion_cost
    }
