"""The project's image maps to the installed `llmpool` console script; other images
need a command."""

from __future__ import annotations

import pytest
from harness import ClusterHandle, container_status, phase

pytestmark = pytest.mark.e2e


def single_container_pod(name: str, container: dict[str, object]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", **container}]},
    }


def test_llmpool_image_runs_the_console_script(cluster: ClusterHandle, namespace: str) -> None:
    container = {"image": "ghcr.io/example/llmpool:dev", "args": ["--help"]}
    cluster.apply(single_container_pod("cli", container), namespace=namespace)
    current = cluster.wait_finished(namespace, "cli", timeout=120)
    logs = cluster.kubectl("logs", "cli", "-n", namespace)
    assert phase(current) == "Succeeded", logs
    assert "usage: llmpool" in logs


def test_other_images_need_a_command(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(single_container_pod("nocmd", {"image": "nginx"}), namespace=namespace)
    cluster.wait_pod(
        namespace,
        "nocmd",
        "to report a config error",
        lambda p: (
            container_status(p).get("state", {}).get("waiting", {}).get("reason")
            == "CreateContainerConfigError"
        ),
    )
