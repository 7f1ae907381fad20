"""The control plane is the built release, and kubectl and helm drive it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from controlplane import versions
from harness import ClusterHandle

pytestmark = pytest.mark.e2e


def test_version_is_the_built_release(cluster: ClusterHandle) -> None:
    info = json.loads(cluster.kubectl("get", "--raw", "/version"))
    assert info["gitVersion"] == versions.KUBERNETES
    major, minor, _ = versions.KUBERNETES.lstrip("v").split(".")
    assert (info["major"], info["minor"]) == (major, minor)


def test_node_is_ready(cluster: ClusterHandle) -> None:
    node = cluster.get("node", "e2e-node")
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == versions.KUBERNETES
    assert info["containerRuntimeVersion"].startswith("containerd://"), info


def test_helm_version(cluster: ClusterHandle) -> None:
    assert cluster.helm("version", "--short").startswith(versions.HELM)


def test_helm_installs_a_chart(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: tiny\ndata:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    cluster.helm("install", "tiny", str(chart), "-n", namespace, "--set", "greeting=hi", "--wait")
    assert cluster.get("configmap", "tiny", "-n", namespace)["data"] == {"greeting": "hi"}
    cluster.helm("uninstall", "tiny", "-n", namespace, "--wait")
    gone = cluster.run("kubectl", "get", "configmap", "tiny", "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
