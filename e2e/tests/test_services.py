"""Services on the node: kube-proxy routes ClusterIPs (from pods and from the host), CoreDNS
resolves ``<service>.<namespace>.svc.cluster.local`` in pods, and a pod reaches itself
through its own Service."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from controlplane import topology
from harness import IMAGE, ClusterHandle, deployment, phase, pod_ready, wait_for

pytestmark = pytest.mark.e2e

LABELS = {"app": "echo"}
# Answers with the pod's own name, so a client can tell which replica it reached.
SERVER = (
    "import http.server, os\n"
    "class Name(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = os.environ['POD_NAME'].encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers(); self.wfile.write(body)\n"
    "http.server.ThreadingHTTPServer(('', 8080), Name).serve_forever()\n"
)


def echo_deployment(replicas: int) -> dict[str, Any]:
    container = {
        "name": "echo",
        "image": IMAGE,
        "command": ["python3", "-c", SERVER],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 1},
    }
    return deployment("echo", LABELS, container, replicas)


SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "echo"},
    "spec": {"selector": LABELS, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
}


def run_client(cluster: ClusterHandle, namespace: str, name: str, code: str) -> str:
    """Run ``code`` with python3 in a pod of the project's image; return its output."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": IMAGE, "command": ["python3", "-c", code]}],
        },
    }
    cluster.apply(pod, namespace=namespace)
    finished = cluster.wait_finished(namespace, name, timeout=120)
    logs = cluster.kubectl("logs", name, "-n", namespace)
    assert phase(finished) == "Succeeded", logs
    return logs


def ready_echo_pods(cluster: ClusterHandle, namespace: str, count: int) -> set[str]:
    def probe() -> set[str] | None:
        pods = cluster.get("pods", "-n", namespace, "-l", "app=echo")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = {p["metadata"]["name"] for p in live if pod_ready(p)}
        return ready if len(ready) == count == len(live) else None

    return wait_for(f"{count} ready echo pods", probe)


def endpoints_ready(cluster: ClusterHandle, namespace: str, count: int) -> None:
    """Wait for the EndpointSlices; kube-proxy programs its rules from them a moment later
    (until then the ClusterIP refuses connections), so callers retry their first request."""

    def probe() -> bool:
        slices = cluster.get(
            "endpointslices", "-n", namespace, "-l", "kubernetes.io/service-name=echo"
        )["items"]
        ready = [
            e
            for s in slices
            for e in s.get("endpoints") or []
            if e.get("conditions", {}).get("ready")
        ]
        return len(ready) == count

    wait_for(f"{count} ready endpoints of Service echo", probe)


def test_dns_names_and_cluster_ips_reach_every_replica(
    cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(echo_deployment(2), SERVICE, namespace=namespace)
    names = ready_echo_pods(cluster, namespace, 2)
    endpoints_ready(cluster, namespace, 2)
    cluster_ip = cluster.get("service", "echo", "-n", namespace)["spec"]["clusterIP"]
    fqdn = f"echo.{namespace}.svc.{topology.CLUSTER_DOMAIN}"
    code = (
        "import socket, time, urllib.request\n"
        f"print('resolved', socket.gethostbyname('{fqdn}'))\n"
        "print('short', socket.gethostbyname('echo'))\n"
        "print('api', socket.gethostbyname('kubernetes.default.svc'))\n"
        "def get():\n"
        f"    return urllib.request.urlopen('http://{fqdn}/', timeout=5).read().decode()\n"
        "for _ in range(30):  # until kube-proxy has the endpoints\n"
        "    try:\n"
        "        seen = {get()}\n"
        "        break\n"
        "    except OSError:\n"
        "        time.sleep(1)\n"
        "deadline = time.monotonic() + 60  # kube-proxy may add the second endpoint later\n"
        "for _ in range(40):\n"
        "    seen.add(get())\n"
        f"while len(seen) < {len(names)} and time.monotonic() < deadline:\n"
        "    seen.add(get())\n"
        "    time.sleep(0.2)\n"
        "print('reached', ' '.join(sorted(seen)))\n"
    )
    logs = run_client(cluster, namespace, "client", code)
    assert f"resolved {cluster_ip}" in logs
    assert f"short {cluster_ip}" in logs  # the pod's search path holds its namespace
    assert f"api {topology.KUBERNETES_SERVICE_IP}" in logs
    assert f"reached {' '.join(sorted(names))}" in logs, logs


def test_a_pod_reaches_itself_through_its_service(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(echo_deployment(1), SERVICE, namespace=namespace)
    (name,) = ready_echo_pods(cluster, namespace, 1)
    endpoints_ready(cluster, namespace, 1)
    fetch = "import urllib.request; print(urllib.request.urlopen('http://echo/', timeout=5).read())"

    def through_own_service() -> str | None:
        found = cluster.run(
            "kubectl", "exec", name, "-n", namespace, "--", "python3", "-c", fetch, check=False
        )
        return found.stdout if found.returncode == 0 else None

    assert name in wait_for("the pod to reach itself by its Service", through_own_service, 30)


def test_the_host_reaches_a_cluster_ip(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(echo_deployment(1), SERVICE, namespace=namespace)
    (name,) = ready_echo_pods(cluster, namespace, 1)
    endpoints_ready(cluster, namespace, 1)
    cluster_ip = cluster.get("service", "echo", "-n", namespace)["spec"]["clusterIP"]

    def through_cluster_ip() -> str | None:
        try:
            with urllib.request.urlopen(f"http://{cluster_ip}/", timeout=10) as response:
                return response.read().decode()
        except OSError:
            return None

    assert wait_for("the host to reach the ClusterIP", through_cluster_ip, 30) == name
