"""A Deployment of a small HTTP server: pods get their own IPs, scale, and are collected."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from harness import IMAGE, ClusterHandle, deployment, pod_ready, wait_for

pytestmark = pytest.mark.e2e

LABELS = {"app": "web"}


def web_deployment(replicas: int) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": IMAGE,
        # Every pod has its own network namespace, so all of them can bind 0.0.0.0:8080.
        "command": ["python3", "-m", "http.server", "8080", "--bind", "0.0.0.0"],
        "workingDir": "/tmp",
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    return deployment("web", LABELS, container, replicas)


def ready_pods(cluster: ClusterHandle, namespace: str, count: int) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        pods = cluster.get("pods", "-n", namespace, "-l", "app=web")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ok = len(pods) == count and all(
            p["status"].get("phase") == "Running" and pod_ready(p) for p in live
        )
        return live if ok else None

    return wait_for(f"{count} ready web pods", probe)


def answers(ip: str) -> bool:
    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as resp:
        return resp.status == 200


def test_deployment_runs_scales_and_is_collected(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(web_deployment(2), namespace=namespace)
    pods = ready_pods(cluster, namespace, 2)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2, ips
    assert all(answers(ip) for ip in ips)
    assert {p["status"]["hostIP"] for p in pods} == {"10.244.0.1"}

    cluster.kubectl("scale", "deployment/web", "--replicas=3", "-n", namespace)
    pods = ready_pods(cluster, namespace, 3)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 3 and all(answers(ip) for ip in ips)

    cluster.kubectl("scale", "deployment/web", "--replicas=2", "-n", namespace)
    ready_pods(cluster, namespace, 2)

    cluster.kubectl("delete", "deployment/web", "-n", namespace)

    def collected() -> bool:
        left = cluster.get("replicasets,pods", "-n", namespace, "-l", "app=web")["items"]
        return not left

    wait_for("the ReplicaSet and pods to be garbage-collected", collected)
