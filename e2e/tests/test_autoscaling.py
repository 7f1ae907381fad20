"""Autoscaling on the real control plane, through the gateway: from zero, up on load, back down.

The operator and the gateway run as local processes (one namespace each); the engines are real
`llmpool serve` pods. The pool's windows are short so that the whole life of a pool (0 -> 1 on
the first request, 1 -> 2 under load, 2 -> 1 -> 0 when idle, an operator restart in between)
fits in a few minutes.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import (
    ENGINE_START_SECONDS,
    ROOT,
    ClusterHandle,
    GatewayProcess,
    OperatorProcess,
    apply_crds,
    live_pods,
    pod_ready,
    wait_for,
)

pytestmark = pytest.mark.e2e

POOL = "smollm2-chat"
MODEL = "smollm2"
AUTOSCALING = {
    "minReplicas": 0,
    "maxReplicas": 2,
    "targetInFlightPerReplica": 1,
    "windowSeconds": 12,
    "scaleUpStabilizationSeconds": 4,
    "scaleDownDelaySeconds": 30,
}
SCALE_REASONS = ("ScaledFromZero", "ScaledUp", "ScaledDown")


def seconds(rfc3339: str) -> float:
    return datetime.datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%S%z").timestamp()


def pool_object() -> dict[str, Any]:
    documents = yaml.safe_load_all((ROOT / "examples" / "smollm2-interactive.yaml").read_text())
    pool = next(d for d in documents if d["kind"] == "LLMPool")
    spec = pool["spec"]
    spec.pop("chatTemplate")
    spec.pop("replicas")
    spec.pop("resources", None)
    spec["autoscaling"] = AUTOSCALING
    spec["maxModelLen"] = 512
    spec["engine"] = {**spec["engine"], "maxNumSeqs": 8, "kvCacheMemory": "32Mi"}
    return pool


def autoscaling_status(cluster: ClusterHandle, namespace: str) -> dict[str, Any]:
    status = cluster.get("llmpool", POOL, "-n", namespace).get("status") or {}
    return status.get("autoscaling") or {}


def deployment_replicas(cluster: ClusterHandle, namespace: str) -> int | None:
    found = cluster.run(
        "kubectl", "get", "deployment", POOL, "-n", namespace, "-o", "json", check=False
    )
    return json.loads(found.stdout)["spec"]["replicas"] if found.returncode == 0 else None


def scale_events(cluster: ClusterHandle, namespace: str) -> Counter[str]:
    events = cluster.get("events", "-n", namespace)["items"]
    counts: Counter[str] = Counter()
    for event in events:
        if event["involvedObject"].get("name") == POOL and event["reason"] in SCALE_REASONS:
            counts[event["reason"]] += event.get("count") or 1
    return counts


class Load:
    """Clients that keep ``concurrency`` requests in flight through the gateway until stopped."""

    def __init__(self, gateway: GatewayProcess, concurrency: int) -> None:
        self.gateway = gateway
        self.statuses: Counter[int] = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(concurrency)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def _client(self, index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            status, _ = self.gateway.complete(
                f"Client {index} turn {turn}: tell me a story", MODEL, max_tokens=32, timeout=300
            )
            with self._lock:
                self.statuses[status] += 1
            turn += 1


def starts_at_zero(cluster: ClusterHandle, namespace: str) -> None:
    """The pool starts with no replica, and `kubectl scale` of it is refused."""
    cluster.apply(pool_object(), namespace=namespace)
    wait_for("the Deployment at 0", lambda: deployment_replicas(cluster, namespace) == 0, 60)
    assert autoscaling_status(cluster, namespace)["desiredReplicas"] == 0
    assert live_pods(cluster, namespace, POOL) == []
    # `kubectl scale` of an autoscaled pool is refused: the autoscaler owns the count.
    scaled = cluster.run(
        "kubectl", "scale", "llmpool", POOL, "-n", namespace, "--replicas=3", check=False
    )
    assert scaled.returncode != 0 and "not both" in scaled.stderr, scaled.stderr


def first_request_scales_from_zero(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess
) -> None:
    """The first request is held by the gateway until the pool has a Ready replica."""
    started = time.monotonic()
    status, body = gateway.complete(
        "Hello there", MODEL, max_tokens=4, timeout=ENGINE_START_SECONDS
    )
    first_answer = time.monotonic() - started
    assert status == 200, body
    print(f"first request from zero answered in {first_answer:.1f}s")
    assert scale_events(cluster, namespace) == {"ScaledFromZero": 1}


def load_scales_up_to_max(cluster: ClusterHandle, namespace: str, gateway: GatewayProcess) -> None:
    """Four clients against a target of one request per replica: up to maxReplicas, held there."""
    with Load(gateway, concurrency=4) as load:
        wait_for(
            "two ready replicas",
            lambda: len([p for p in live_pods(cluster, namespace, POOL) if pod_ready(p)]) == 2,
            ENGINE_START_SECONDS,
            1,
        )
        wait_for(
            "HeldAtMax",
            lambda: autoscaling_status(cluster, namespace).get("reason") == "HeldAtMax",
            60,
            1,
        )
    assert set(load.statuses) == {200}, load.statuses  # nothing lost while scaling
    assert scale_events(cluster, namespace) == {"ScaledFromZero": 1, "ScaledUp": 1}


def restart_keeps_the_scale_down_clock(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> str:
    """Idle: the scale-down clock starts; the operator restarted meanwhile does not reset it.
    The time the clock started (``belowSince``)."""
    below = wait_for(
        "the scale-down clock",
        lambda: autoscaling_status(cluster, namespace).get("belowSince"),
        60,
        1,
    )
    before = autoscaling_status(cluster, namespace)
    operator.stop()
    time.sleep(10)
    operator.start()
    after = wait_for(
        "the restarted operator's first pass",
        lambda: (
            (s := autoscaling_status(cluster, namespace)).get("window") != before["window"] and s
        ),
        60,
        1,
    )
    # The clocks were not reset: the scale-down still counts from before the restart.
    assert after["belowSince"] == before["belowSince"] == below
    assert after["lastScaleTime"] == before["lastScaleTime"]
    return below


def steps_down_to_zero(cluster: ClusterHandle, namespace: str, below: str) -> None:
    """One step down at ``below`` + the delay, then to zero: 0 -> 1 -> 2 -> 1 -> 0 in all."""
    wait_for("the first step down", lambda: deployment_replicas(cluster, namespace) == 1, 120, 1)
    stepped = autoscaling_status(cluster, namespace)
    # At belowSince + delay (a pass is 2 s), not delay after the restart (10 s later or more).
    late = seconds(stepped["lastScaleTime"]) - seconds(below)
    assert AUTOSCALING["scaleDownDelaySeconds"] <= late <= AUTOSCALING["scaleDownDelaySeconds"] + 8

    wait_for("the scale to zero", lambda: deployment_replicas(cluster, namespace) == 0, 240, 1)
    status_now = autoscaling_status(cluster, namespace)
    assert status_now["desiredReplicas"] == 0 and status_now["reason"] == "ScaledDown"
    wait_for("no engine pods", lambda: live_pods(cluster, namespace, POOL) == [], 120, 1)
    # One step each way, no flapping: 0 -> 1 -> 2 -> 1 -> 0.
    assert scale_events(cluster, namespace) == {
        "ScaledFromZero": 1,
        "ScaledUp": 1,
        "ScaledDown": 2,
    }
    print(f"autoscaling status at the end: {json.dumps(status_now)}")


def test_a_pool_scales_from_zero_up_on_load_and_back_to_zero(
    cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> None:
    apply_crds(cluster)
    operator = OperatorProcess(cluster, tmp_path / "operator.log", "-n", namespace, "--standalone")
    operator.start()
    gateway = GatewayProcess(cluster, namespace, tmp_path / "gateway.log", hold_timeout=600)
    try:
        starts_at_zero(cluster, namespace)
        first_request_scales_from_zero(cluster, namespace, gateway)
        load_scales_up_to_max(cluster, namespace, gateway)
        below = restart_keeps_the_scale_down_clock(cluster, namespace, operator)
        steps_down_to_zero(cluster, namespace, below)
    finally:
        gateway.stop()
        cluster.run(
            "kubectl", "delete", "llmpool", POOL, "-n", namespace, "--timeout=120s", check=False
        )
        operator.stop()
