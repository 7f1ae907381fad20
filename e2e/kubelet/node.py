"""Node registration and heartbeats (a Lease every 10 s, node status every minute)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import threading

from controlplane import topology, versions

from .api import Api, ApiError, Json

log = logging.getLogger(__name__)
LEASE_SECONDS = 40
LEASE_RENEW_SECONDS = 10
STATUS_EVERY_SECONDS = 60


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _memory_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    raise RuntimeError("MemTotal missing from /proc/meminfo")


def node_status(name: str, kubelet_port: int, since: str) -> Json:
    resources = {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{_memory_kib()}Ki",
        "pods": "110",
        "ephemeral-storage": "100Gi",
    }
    stamp = now()

    def condition(kind: str, status: str, reason: str, message: str) -> Json:
        return {"type": kind, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": stamp, "lastTransitionTime": since}  # fmt: skip

    return {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            condition(
                "MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"
            ),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "no PID pressure"),
            condition(
                "Ready", "True", "KubeletReady", "llmpool e2e kubelet is posting ready status"
            ),
        ],
        "addresses": [
            {"type": "InternalIP", "address": topology.POD_GATEWAY},
            {"type": "Hostname", "address": name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": platform.release(),
            "osImage": "llmpool e2e host",
            "containerRuntimeVersion": "llmpool-e2e://processes",
            "kubeletVersion": versions.KUBERNETES,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64" if platform.machine() == "x86_64" else platform.machine(),
        },  # fmt: skip
    }


class NodeAgent:
    """Registers the Node and keeps it Ready until stopped."""

    def __init__(self, api: Api, name: str, kubelet_port: int) -> None:
        self.api, self.name, self.kubelet_port = api, name, kubelet_port
        self._stop = threading.Event()
        self._since = now()

    def register(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                },
            },
        }
        try:
            self.api.create("/api/v1/nodes", body)
        except ApiError as err:
            if err.status != 409:
                raise
        self._post_status()
        self._renew_lease()

    def _post_status(self) -> None:
        self.api.patch(
            f"/api/v1/nodes/{self.name}/status",
            {"status": node_status(self.name, self.kubelet_port, self._since)},
        )

    def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": now().replace("Z", ".000000Z"),
        }
        try:
            self.api.patch(path, {"spec": spec}, kind="merge-patch")
        except ApiError as err:
            if err.status != 404:
                raise
            node = self.api.get(f"/api/v1/nodes/{self.name}")
            owner = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.name,
                "uid": node["metadata"]["uid"],
            }
            body = {"metadata": {"name": self.name, "ownerReferences": [owner]}, "spec": spec}
            self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", body)

    def run(self) -> None:
        """Heartbeat loop; errors are logged and retried on the next beat."""
        beats = 0
        while not self._stop.wait(LEASE_RENEW_SECONDS):
            beats += 1
            try:
                self._renew_lease()
                if beats % (STATUS_EVERY_SECONDS // LEASE_RENEW_SECONDS) == 0:
                    self._post_status()
            except Exception:  # noqa: BLE001 - a missed beat must not end the heartbeat
                log.exception("node heartbeat failed")

    def stop(self) -> None:
        self._stop.set()
