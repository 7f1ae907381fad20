"""Images on the node: the project's image, loaded into containerd, runs its ENTRYPOINT; the
node pulls nothing (no registry is reachable), so an image it lacks is never run."""

from __future__ import annotations

import pytest
from harness import IMAGE, ClusterHandle, container_status, phase

pytestmark = pytest.mark.e2e


def single_container_pod(name: str, container: dict[str, object]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", **container}]},
    }


def test_the_project_image_runs_its_entrypoint(cluster: ClusterHandle, namespace: str) -> None:
    container = {"image": IMAGE, "imagePullPolicy": "Never", "args": ["--help"]}
    cluster.apply(single_container_pod("cli", container), namespace=namespace)
    current = cluster.wait_finished(namespace, "cli", timeout=120)
    logs = cluster.kubectl("logs", "cli", "-n", namespace)
    assert phase(current) == "Succeeded", logs
    assert "usage: llmpool" in logs


def test_an_image_the_node_lacks_is_not_run(cluster: ClusterHandle, namespace: str) -> None:
    container = {"image": "ghcr.io/example/absent:dev", "imagePullPolicy": "Never"}
    cluster.apply(single_container_pod("absent", container), namespace=namespace)
    cluster.wait_pod(
        namespace,
        "absent",
        "to report the missing image",
        lambda p: (
            container_status(p).get("state", {}).get("waiting", {}).get("reason")
            == "ErrImageNeverPull"
        ),
    )
