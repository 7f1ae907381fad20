"""Fixtures for the operator's unit tests: the CRD schema (with a small structural defaulter and
validator for what the API server would do before CEL), example pools and pod/deployment bodies."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "llmpool.yaml"
EXAMPLES = ROOT / "examples"
DIGEST = "sha256:" + "d" * 64


class Schema:
    """Structural defaulting and validation of a subset of OpenAPI v3 (what the CRD uses)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def at(self, *path: str) -> dict[str, Any]:
        node = self.root
        for name in path:
            node = node["items"] if name == "[]" else node["properties"][name]
        return node

    def defaulted(self, obj: Any, node: dict[str, Any] | None = None) -> Any:
        node = self.root if node is None else node
        obj = copy.deepcopy(obj)
        if isinstance(obj, dict) and "properties" in node:
            for name, child in node["properties"].items():
                if name not in obj and "default" in child:
                    obj[name] = copy.deepcopy(child["default"])
                if name in obj:
                    obj[name] = self.defaulted(obj[name], child)
        if isinstance(obj, list) and "items" in node:
            obj = [self.defaulted(item, node["items"]) for item in obj]
        return obj

    def errors(self, obj: Any, node: dict[str, Any] | None = None, path: str = "") -> list[str]:
        node = self.root if node is None else node
        if node.get("x-kubernetes-int-or-string"):
            if not isinstance(obj, int | str):
                return [f"{path}: must be an integer or a string"]
            if isinstance(obj, str) and "pattern" in node and not re.search(node["pattern"], obj):
                return [f"{path}: {obj!r} does not match {node['pattern']}"]
            return []
        kind = node.get("type")
        checks: dict[str | None, Any] = {
            "object": dict,
            "array": list,
            "string": str,
            "integer": int,
            "number": int | float,
            "boolean": bool,
        }
        expected = checks.get(kind)
        if expected and (
            not isinstance(obj, expected) or kind != "boolean" and isinstance(obj, bool)
        ):
            return [f"{path}: expected {kind}, got {obj!r}"]
        errors = []
        if "enum" in node and obj not in node["enum"]:
            errors.append(f"{path}: {obj!r} not in {node['enum']}")
        if "pattern" in node and isinstance(obj, str) and not re.search(node["pattern"], obj):
            errors.append(f"{path}: {obj!r} does not match {node['pattern']}")
        if "minimum" in node and obj < node["minimum"]:
            errors.append(f"{path}: {obj} below {node['minimum']}")
        if "maximum" in node and obj > node["maximum"]:
            errors.append(f"{path}: {obj} above {node['maximum']}")
        if "maxLength" in node and len(obj) > node["maxLength"]:
            errors.append(f"{path}: longer than {node['maxLength']}")
        if isinstance(obj, dict):
            for name in node.get("required", []):
                if name not in obj:
                    errors.append(f"{path}.{name}: required")
            properties = node.get("properties", {})
            for name, value in obj.items():
                if name in properties:
                    errors += self.errors(value, properties[name], f"{path}.{name}")
                elif "additionalProperties" in node:
                    errors += self.errors(value, node["additionalProperties"], f"{path}.{name}")
                elif path != ".metadata":
                    errors.append(f"{path}.{name}: unknown field")
        if isinstance(obj, list) and "items" in node:
            for index, item in enumerate(obj):
                errors += self.errors(item, node["items"], f"{path}[{index}]")
        return errors


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def schema(crd: dict[str, Any]) -> Schema:
    return Schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def load_example_pools() -> dict[str, dict[str, Any]]:
    pools = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == "LLMPool":
                pools[document["metadata"]["name"]] = document
    return pools


@pytest.fixture
def chat_pool(schema: Schema) -> dict[str, Any]:
    """The interactive example as the API server stores it (defaults applied)."""
    return schema.defaulted(load_example_pools()["smollm2-chat"])


@pytest.fixture
def chat_spec(chat_pool: dict[str, Any]) -> dict[str, Any]:
    return chat_pool["spec"]


@pytest.fixture
def batch_spec(schema: Schema) -> dict[str, Any]:
    return schema.defaulted(load_example_pools()["smollm2-batch"])["spec"]


@pytest.fixture(scope="session")
def chat_template() -> str:
    documents = yaml.safe_load_all((EXAMPLES / "smollm2-interactive.yaml").read_text())
    configmap = next(d for d in documents if d["kind"] == "ConfigMap")
    return configmap["data"]["template"]


def pod_body(
    name: str,
    *,
    digest: str = DIGEST,
    ready: bool = True,
    ip: str | None = "10.0.0.1",
    restart_count: int = 0,
    waiting: str | None = None,
    terminated: dict[str, Any] | None = None,
    last_terminated: dict[str, Any] | None = None,
    deleting: bool = False,
    replica_set: str | None = "chat-5c8d9f",
) -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}}
    if waiting:
        state = {"waiting": {"reason": waiting}}
    if terminated:
        state = {"terminated": terminated}
    metadata: dict[str, Any] = {
        "name": name,
        "uid": f"uid-{name}",
        "annotations": {"llmpool.dev/pinned-digest": digest},
        "labels": {"llmpool.dev/pool": "chat", "pod-template-hash": "5c8d9f"},
    }
    if replica_set is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replica_set, "controller": True}
        ]
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [
                {
                    "name": "engine",
                    "restartCount": restart_count,
                    "state": state,
                    "lastState": {"terminated": last_terminated} if last_terminated else {},
                }
            ],
        },
    }


def deployment_body(
    *,
    digest: str = DIGEST,
    replicas: int = 2,
    ready: int = 2,
    updated: int = 2,
    status_replicas: int | None = None,
    generation: int = 1,
    observed_generation: int = 1,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {
            "replicas": replicas,
            "template": {"metadata": {"annotations": {"llmpool.dev/pinned-digest": digest}}},
        },
        "status": {
            "observedGeneration": observed_generation,
            "replicas": replicas if status_replicas is None else status_replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "availableReplicas": ready,
        },
    }


@pytest.fixture
def make_pod() -> Any:
    return pod_body


@pytest.fixture
def make_deployment() -> Any:
    return deployment_body


@pytest.fixture
def example_pools() -> dict[str, dict[str, Any]]:
    """Every LLMPool in examples/, by name, as written."""
    return load_example_pools()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
