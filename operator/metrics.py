"""The operator's Prometheus metrics, served on --metrics-port."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, start_http_server

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
POOL_METRICS = (DRIFTED_REPLICAS, READY_REPLICAS, RECREATED_PODS, FINGERPRINT_ERRORS)


def serve(port: int) -> None:
    start_http_server(port)


def forget_pool(namespace: str, pool: str) -> None:
    """Drop a deleted pool's series."""
    for metric in POOL_METRICS:
        with contextlib.suppress(KeyError):
            metric.remove(namespace, pool)
