"""The operator never adopts what it did not create, and keys each pool's engines, on the real
control plane.

The operator runs as a local process watching only the test's namespace, with a fleet key. The
pools have zero replicas: what is checked is which objects the operator writes, not engines.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import ClusterHandle, OperatorProcess, namespace_operator, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FLEET_KEY = "e2e-fleet-key-0123456789abcdef"
REVISION = "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SETTLE_SECONDS = 60


@pytest.fixture
def operator(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    key_file = tmp_path / "fleet-key"
    key_file.write_text(FLEET_KEY)
    keyed = dataclasses.replace(
        cluster, env={**cluster.env, "LLMPOOL_FLEET_KEY_FILE": str(key_file)}
    )
    with namespace_operator(keyed, namespace, tmp_path / "operator.log") as process:
        yield process
    print(f"operator log: {process.log_path}")


def pool(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "llmpool.dev/v1alpha1",
        "kind": "LLMPool",
        "metadata": {"name": name},
        "spec": {
            "replicas": 0,
            "model": {"source": "builtin://smollm2-135m-instruct", "revision": REVISION},
            "engine": {"kvCacheMemory": "32Mi"},
        },
    }


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """What must not change: identity, labels, annotations, owners, spec and field managers."""
    metadata = obj["metadata"]
    return {
        "uid": metadata["uid"],
        "labels": metadata.get("labels"),
        "annotations": metadata.get("annotations"),
        "ownerReferences": metadata.get("ownerReferences"),
        "managers": sorted(m["manager"] for m in metadata.get("managedFields") or []),
        "spec": obj.get("spec"),
    }


def condition(cluster: ClusterHandle, namespace: str, name: str, kind: str) -> dict[str, Any]:
    status = cluster.get("llmpool", name, "-n", namespace).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def events(cluster: ClusterHandle, namespace: str, name: str) -> list[dict[str, Any]]:
    found = cluster.get("events", "-n", namespace)["items"]
    return [e for e in found if e["involvedObject"].get("name") == name]


def test_an_existing_service_survives_a_pool_of_its_name(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    name = "taken"
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "labels": {"team": "other"},
            "annotations": {"owner": "another team"},
        },
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 1234, "targetPort": 1234}]},
    }
    cluster.apply(theirs, namespace=namespace)
    before = comparable(cluster.get("service", name, "-n", namespace))

    cluster.apply(pool(name), namespace=namespace)
    degraded = wait_for(
        "Degraded=True OwnershipConflict",
        lambda: (
            c
            if (c := condition(cluster, namespace, name, "Degraded")).get("reason")
            == "OwnershipConflict"
            else None
        ),
        SETTLE_SECONDS,
        interval=1,
    )
    assert degraded["status"] == "True"
    assert f"Service {name} already exists" in degraded["message"]
    warning = wait_for(
        "a Warning Event naming the Service",
        lambda: next(
            (
                e
                for e in events(cluster, namespace, name)
                if e["reason"] == "OwnershipConflict" and f"Service {name}" in e["message"]
            ),
            None,
        ),
        SETTLE_SECONDS,
        interval=1,
    )
    assert warning["type"] == "Warning"
    # No half-applied pool: none of its children exists.
    for kind in ("deployment", "configmap", "secret", "poddisruptionbudget", "llmpooldemand"):
        found = cluster.kubectl("get", kind, "-n", namespace, "-l", f"llmpool.dev/pool={name}")
        assert name not in found, f"a {kind} was applied: {found}"
    assert comparable(cluster.get("service", name, "-n", namespace)) == before

    cluster.kubectl("delete", "llmpool", name, "-n", namespace, "--timeout=60s")
    assert comparable(cluster.get("service", name, "-n", namespace)) == before


def test_a_pools_engines_read_their_key_from_the_pools_own_secret(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    name = "keyed"
    cluster.apply(pool(name), namespace=namespace)
    secret_name = f"{name}-engine-key"
    uid = wait_for(
        "the pool's uid",
        lambda: cluster.get("llmpool", name, "-n", namespace)["metadata"]["uid"],
        30,
    )

    def deployment() -> dict[str, Any] | None:
        found = cluster.run(
            "kubectl", "get", "deployment", name, "-n", namespace, "-o", "json", check=False
        )
        return json.loads(found.stdout) if found.returncode == 0 else None

    applied = wait_for("the pool's Deployment", deployment, SETTLE_SECONDS, interval=1)
    secret = cluster.get("secret", secret_name, "-n", namespace)
    owners = secret["metadata"]["ownerReferences"]
    assert [(o["kind"], o["uid"], o["controller"]) for o in owners] == [("LLMPool", uid, True)]
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert key.startswith("llmpool-")
    container = applied["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "LLMPOOL_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": secret_name, "key": "api-key"}}} in container["env"]  # fmt: skip
    assert "memory" in container["resources"]["limits"]
    annotations = applied["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["llmpool.dev/engine-key-hash"] == hashlib.sha256(key.encode()).hexdigest()[:16]
    )
    # The key is in the Secret only: not in the pod template, the pool's status or its Events.
    assert key not in json.dumps(applied)
    assert key not in json.dumps(cluster.get("llmpool", name, "-n", namespace))
    assert key not in json.dumps(events(cluster, namespace, name))
    assert key not in operator.log()
    cluster.get("llmpooldemand", name, "-n", namespace)

    # Edited by hand: restored.
    cluster.kubectl(
        "patch", "secret", secret_name, "-n", namespace, "--type=merge",
        "-p", json.dumps({"data": {"api-key": base64.b64encode(b"guessed").decode()}}),
    )  # fmt: skip
    wait_for(
        "the Secret restored",
        lambda: (
            cluster.get("secret", secret_name, "-n", namespace)["data"]["api-key"]
            == secret["data"]["api-key"]
        ),
        SETTLE_SECONDS,
        interval=1,
    )


def test_gateway_demand_records_scale_a_pool_from_zero_and_future_ones_do_not(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    name = "on-demand"
    body = pool(name)
    del body["spec"]["replicas"]
    body["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1}
    cluster.apply(body, namespace=namespace)
    wait_for(
        "the pool's LLMPoolDemand",
        lambda: (
            cluster.run(
                "kubectl", "get", "llmpooldemand", name, "-n", namespace, check=False
            ).returncode
            == 0
        ),
        SETTLE_SECONDS,
        interval=1,
    )

    def record(replica: str, held: int, at: float) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        patch = {"status": {"gateways": {replica: {"held": held, "at": stamp}}}}
        cluster.kubectl(
            "patch", "llmpooldemand", name, "-n", namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps(patch),
        )  # fmt: skip

    def desired() -> int | None:
        status = cluster.get("llmpool", name, "-n", namespace).get("status") or {}
        return (status.get("autoscaling") or {}).get("desiredReplicas")

    wait_for("the autoscaler's first decision", lambda: desired() == 0, SETTLE_SECONDS, 1)
    # Dated an hour ahead: it would never expire, so it counts for nothing.
    record("gateway-a", 5, time.time() + 3600)
    time.sleep(6)
    assert desired() == 0
    # A second gateway replica's fresh record stands beside the first one's.
    record("gateway-b", 1, time.time())
    wait_for("a scale from zero", lambda: desired() == 1, 30, interval=0.5)
    records = cluster.get("llmpooldemand", name, "-n", namespace)["status"]["gateways"]
    assert sorted(records) == ["gateway-a", "gateway-b"]
    cluster.kubectl("delete", "llmpool", name, "-n", namespace, "--timeout=60s")
