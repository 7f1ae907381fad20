"""The operator's Prometheus metrics, served on --metrics-port."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, start_http_server

from llmpool.operator.autoscaling import CHANGES

DRIFTED_REPLICAS = Gauge(
    "llmpool_operator_drifted_replicas",
    "Replicas of a pool whose fingerprint differs from the pin or from their siblings",
    ["namespace", "pool"],
)
READY_REPLICAS = Gauge(
    "llmpool_operator_ready_replicas", "Ready engine replicas of a pool", ["namespace", "pool"]
)
RECREATED_PODS = Counter(
    "llmpool_operator_recreated_pods_total",
    "Drifted pods deleted under drift policy Recreate",
    ["namespace", "pool"],
)
FINGERPRINT_ERRORS = Counter(
    "llmpool_operator_fingerprint_errors_total",
    "GET /fingerprint requests to ready pods that failed",
    ["namespace", "pool"],
)
DESIRED_REPLICAS = Gauge(
    "llmpool_operator_desired_replicas",
    "Replicas the operator asks of a pool's Deployment (spec.replicas or the autoscaler's)",
    ["namespace", "pool"],
)
POOL_LOAD = Gauge(
    "llmpool_operator_pool_load",
    "An autoscaled pool's load: requests running, waiting and held, averaged over its window",
    ["namespace", "pool"],
)
SCALINGS = Counter(
    "llmpool_operator_scalings_total",
    "Replica count changes made by the autoscaler, by reason",
    ["namespace", "pool", "reason"],
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
