"""The operator's Prometheus metrics, served on --metrics-port."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, start_http_server

from llmpool.operator.autoscaling import CHANGES

POOL_LABELS = ("namespace", "pool")


def _pool_gauge(name: str, doc: str) -> Gauge:
    """A gauge of each pool, named under ``llmpool_operator_`` and labelled by the pool."""
    return Gauge(f"llmpool_operator_{name}", doc, POOL_LABELS)


def _pool_counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    """A counter of each pool (``_total``), labelled by the pool before ``labels``."""
    return Counter(f"llmpool_operator_{name}_total", doc, [*POOL_LABELS, *labels])


DRIFTED_REPLICAS = _pool_gauge(
    "drifted_replicas",
    "Replicas of a pool whose fingerprint differs from the pin or from their siblings",
)
READY_REPLICAS = _pool_gauge("ready_replicas", "Ready engine replicas of a pool")
RECREATED_PODS = _pool_counter("recreated_pods", "Drifted pods deleted under drift policy Recreate")
FINGERPRINT_ERRORS = _pool_counter(
    "fingerprint_errors", "GET /fingerprint requests to ready pods that failed"
)
DESIRED_REPLICAS = _pool_gauge(
    "desired_replicas",
    "Replicas the operator asks of a pool's Deployment (spec.replicas or the autoscaler's)",
)
POOL_LOAD = _pool_gauge(
    "pool_load",
    "An autoscaled pool's load: requests running, waiting and held, averaged over its window",
)
SCALINGS = _pool_counter(
    "scalings", "Replica count changes made by the autoscaler, by reason", ("reason",)
)
POOL_METRICS = (
    DRIFTED_REPLICAS,
    READY_REPLICAS,
    RECREATED_PODS,
    FINGERPRINT_ERRORS,
    DESIRED_REPLICAS,
    POOL_LOAD,
)


def serve(port: int) -> None:
    start_http_server(port)


def forget_pool(namespace: str, pool: str) -> None:
    """Drop a deleted pool's series."""
    for metric in POOL_METRICS:
        with contextlib.suppress(KeyError):
            metric.remove(namespace, pool)
    for reason in CHANGES:
        with contextlib.suppress(KeyError):
            SCALINGS.remove(namespace, pool, reason)
