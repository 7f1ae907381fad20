"""Test-side handle on the e2e cluster: real kubectl and helm, and polling helpers."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


@dataclass(frozen=True)
class ClusterHandle:
    kubeconfig: Path
    env: dict[str, str]
    logs_dir: Path

    def run(
        self, *argv: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:  # noqa: A002
        proc = subprocess.run(
            argv,
            input=input,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:  # noqa: A002
        return self.run("kubectl", *args, input=input, check=check).stdout

    def get(self, *args: str) -> dict[str, Any]:
        """``kubectl get ... -o json``, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, *manifests: dict[str, Any], namespace: str | None = None) -> None:
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=yaml.safe_dump_all(manifests))

    def helm(self, *args: str) -> str:
        return self.run("helm", *args).stdout

    def wait_pod(
        self,
        namespace: str,
        name: str,
        what: str,
        done: Callable[[dict[str, Any]], bool],
        timeout: float = 90,
    ) -> dict[str, Any]:
        """Poll pod ``name`` until ``done(pod)``; return the pod."""

        def probe() -> dict[str, Any] | None:
            found = self.run(
                "kubectl", "get", "pod", name, "-n", namespace, "-o", "json", check=False
            )
            pod = json.loads(found.stdout) if found.returncode == 0 else None
            return pod if pod is not None and done(pod) else None

        return wait_for(f"pod {name} {what}", probe, timeout)

    def wait_finished(self, namespace: str, name: str, timeout: float = 90) -> dict[str, Any]:
        """Wait until the pod has phase Succeeded or Failed; return the pod."""
        return self.wait_pod(
            namespace, name, "to finish", lambda p: phase(p) in ("Succeeded", "Failed"), timeout
        )


def wait_for(
    what: str, probe: Callable[[], T | None], timeout: float = 90, interval: float = 0.5
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def phase(pod: dict[str, Any]) -> str:
    return pod.get("status", {}).get("phase", "")


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    """The status of the pod's first container ({} before the kubelet reported any)."""
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return statuses[0] if statuses else {}
