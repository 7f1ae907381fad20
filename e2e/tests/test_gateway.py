"""`llmpool gateway` on the real control plane: its table from real LLMPools and EndpointSlices.

The pool's Service and Deployment are rendered by the operator's own functions and applied, so
the real controllers make the ReplicaSet, the pods and the EndpointSlices the gateway watches;
the test writes the pool's status (Ready, pinnedDigest, drift) as the operator would. The
gateway runs as a local process with the admin kubeconfig and reaches the pods by pod IP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import ClusterHandle, GatewayProcess, pod_ready, wait_for

from llmpool import pinning
from llmpool.operator import naming, render
from llmpool.operator.spec import PoolSpec

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
POOL = "smollm2-chat"
MODEL = "smollm2"
# The operator's default engine image (as in test_helm.py): an `llmpool operator -A` that
# another test runs on the shared cluster renders the same Deployment and rolls no pod.
IMAGE = "llmpool:latest"
ENGINE_START_SECONDS = 600  # first start converts the built-in GGUF model


def pool_object() -> dict[str, Any]:
    """The interactive example, small: two replicas, no chat template ConfigMap to copy.

    Drift is checked hourly and only reported, so that an operator running beside this test
    leaves the drift this test writes alone.
    """
    documents = yaml.safe_load_all((ROOT / "examples" / "smollm2-interactive.yaml").read_text())
    pool = next(d for d in documents if d["kind"] == naming.KIND)
    spec = pool["spec"]
    spec.pop("chatTemplate")
    spec["maxModelLen"] = 512
    spec["engine"] = {**spec["engine"], "maxNumSeqs": 8, "kvCacheMemory": "32Mi"}
    spec.pop("resources", None)
    spec["drift"] = {"policy": "Report", "intervalSeconds": 3600}
    return pool


@pytest.fixture
def engines(cluster: ClusterHandle, namespace: str) -> tuple[list[str], str]:
    """The pool, its Service and Deployment as the operator renders them: ready pods, digest."""
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=established", "crd/llmpools.llmpool.dev")
    obj = pool_object()
    spec = PoolSpec.from_dict(obj["spec"])
    digest = pinning.pinned_digest(pinning.pinned_from_spec(obj["spec"], None))
    cluster.apply(
        obj,
        render.render_service(POOL),
        render.render_deployment(POOL, spec, digest, IMAGE),
        namespace=namespace,
    )
    selector = naming.selector_string(POOL)

    def ready_pods() -> list[str] | None:
        pods = cluster.get("pods", "-n", namespace, "-l", selector)["items"]
        names = sorted(p["metadata"]["name"] for p in pods if pod_ready(p))
        return names if len(names) == spec.replicas else None

    return wait_for("both engine pods ready", ready_pods, ENGINE_START_SECONDS, 2), digest


def set_status(cluster: ClusterHandle, namespace: str, status: dict[str, Any]) -> None:
    cluster.kubectl(
        "patch", "llmpool", POOL, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


@pytest.fixture
def gateway(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(cluster, namespace, tmp_path / "gateway.log")
    yield process
    process.stop()


def test_the_gateway_routes_by_endpointslices_and_pool_status(
    cluster: ClusterHandle,
    namespace: str,
    engines: tuple[list[str], str],
    gateway: GatewayProcess,
) -> None:
    pods, digest = engines
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "2/2",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    # The pods' /fingerprint digests must equal the operator's, or they would get no traffic.
    set_status(cluster, namespace, {"conditions": [ready], "pinnedDigest": digest})
    listed = wait_for(
        "the model listed",
        lambda: json.loads(gateway.get("/v1/models")[1])["data"],
        30,
    )
    assert [m["id"] for m in listed] == [MODEL]

    prompts = [f"Tenant {tenant} asks about the weather" for tenant in range(12)]
    for prompt in prompts:
        status, body = gateway.complete(prompt, MODEL)
        assert status == 200, body
    spread = gateway.sent_to()
    assert set(spread) == set(pods), spread  # the replicas are the slices' pods, by name

    # The operator reports the first pod drifted: it gets nothing while the other answers.
    drifted, healthy = pods
    entry = {"pod": drifted, "field": "chatTemplateSha256", "expected": "a", "actual": "b"}
    set_status(cluster, namespace, {"drift": [entry]})
    wait_for("the drift seen", lambda: _drift_applied(gateway, prompts, drifted), 30, 0.5)
    before = gateway.sent_to()
    for prompt in prompts:
        assert gateway.complete(prompt, MODEL)[0] == 200
    after = gateway.sent_to()
    assert after.get(drifted, 0) == before.get(drifted, 0)
    assert after[healthy] - before[healthy] == len(prompts)

    # Healed: it takes its share again.
    set_status(cluster, namespace, {"drift": []})
    wait_for("the drifted pod back", lambda: _drift_applied(gateway, prompts, None), 30, 0.5)

    status, body = gateway.complete("Hello", "no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def _drift_applied(gateway: GatewayProcess, prompts: list[str], drifted: str | None) -> bool:
    """Whether one round of prompts matches the drift state: none to ``drifted``, or some to all."""
    before = gateway.sent_to()
    for prompt in prompts:
        gateway.complete(prompt, MODEL)
    after = gateway.sent_to()
    got = {pod: after[pod] - before.get(pod, 0) for pod in after}
    if drifted is not None:
        return got.get(drifted, 0) == 0
    return all(count > 0 for count in got.values()) and len(got) == 2
