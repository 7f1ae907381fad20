"""Startup, liveness and readiness probes: HTTP GET, TCP socket and exec."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from .api import Json


def _port(value: int | str, container: Json) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports", []):
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"container {container['name']!r} has no port named {value!r}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return None  # a 3xx answer itself counts as success, like the kubelet's prober


def _http(spec: Json, pod_ip: str, container: Json, timeout: float) -> bool:
    host = spec.get("host") or pod_ip
    scheme = spec.get("scheme", "HTTP").lower()
    path = spec.get("path", "/")
    url = f"{scheme}://{host}:{_port(spec['port'], container)}{path if path.startswith('/') else '/' + path}"
    headers = {h["name"]: h["value"] for h in spec.get("httpHeaders", [])}
    request = urllib.request.Request(url, headers={"User-Agent": "kube-probe/1.32", **headers})
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as resp:
            return 200 <= resp.status < 400
    except urllib.error.HTTPError as err:
        return 300 <= err.code < 400
    except (OSError, ValueError):
        return False


def _tcp(spec: Json, pod_ip: str, container: Json, timeout: float) -> bool:
    try:
        with socket.create_connection(
            (spec.get("host") or pod_ip, _port(spec["port"], container)), timeout=timeout
        ):
            return True
    except OSError:
        return False


def _exec(spec: Json, prefix: list[str], env: dict[str, str], timeout: float) -> bool:
    try:
        proc = subprocess.run(
            [*prefix, *spec["command"]], env=env, capture_output=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@dataclass
class Prober:
    """One probe of one container, with the thresholds Kubernetes applies to it."""

    spec: Json
    container: Json
    successes: int = 0
    failures: int = 0
    result: bool | None = None  # None until the thresholds have decided once
    next_run: float = field(default=0.0)

    def reset(self, started_at: float) -> None:
        self.successes = self.failures = 0
        self.result = None
        self.next_run = started_at + self.spec.get("initialDelaySeconds", 0)

    def due(self) -> bool:
        return time.monotonic() >= self.next_run

    def run(self, pod_ip: str, prefix: list[str], env: dict[str, str]) -> bool | None:
        """Probe once; return the (possibly unchanged) decided result."""
        timeout = float(self.spec.get("timeoutSeconds", 1))
        if "httpGet" in self.spec:
            ok = _http(self.spec["httpGet"], pod_ip, self.container, timeout)
        elif "tcpSocket" in self.spec:
            ok = _tcp(self.spec["tcpSocket"], pod_ip, self.container, timeout)
        elif "exec" in self.spec:
            ok = _exec(self.spec["exec"], prefix, env, timeout)
        else:
            ok = False  # grpc probes are not supported; failing them is the honest answer
        self.next_run = time.monotonic() + self.spec.get("periodSeconds", 10)
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.spec.get("successThreshold", 1):
                self.result = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.spec.get("failureThreshold", 3):
                self.result = False
        return self.result
