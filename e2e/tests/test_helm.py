"""The Helm chart on the real control plane: install, serve both example pools, upgrade, uninstall.

The operator runs as a pod (the local kubelet maps the chart's image to the `llmpool` console
script) under the chart's ServiceAccount and RBAC, so these tests are also the proof that the
rules of operator/rbac.py are enough for it, and `kubectl auth can-i` that they are no more.
Each installed operator watches only its test's namespace, so it never touches the pools of
other tests (or of another operator running on the same cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import IMAGE, ClusterHandle, pod_ready, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "llmpool"
EXAMPLES = [
    ROOT / "examples" / "smollm2-interactive.yaml",
    ROOT / "examples" / "smollm2-batch.yaml",
]
RELEASE = "llmpool"
FULLNAME = "llmpool"  # the release name contains the chart name (templates/_helpers.tpl)
INSTANCE_LABEL = f"app.kubernetes.io/instance={RELEASE}"
POOL_LABEL = "llmpool.dev/pool"
HELM_TIMEOUT_SECONDS = 300
ENGINE_START_SECONDS = 600  # two engines loading the model at once on a busy machine
# The engine image the operator gives pools without spec.image: the one every operator of the
# suite gives them (LLMPOOL_ENGINE_IMAGE), so that an `llmpool operator -A` started by another
# test on a shared cluster (see test_operator.py) renders the same Deployments and the two never
# roll each other's pods.
ENGINE_IMAGE = IMAGE

# The examples as written, made cheap for one busy machine: one replica each and small KV
# caches. Each still has its own maxModelLen and priorityClass.
TEST_SIZES = {
    "smollm2-chat": {"replicas": 1, "maxModelLen": 1024, "kvCacheMemory": "64Mi"},
    "smollm2-batch": {"replicas": 1, "maxModelLen": 2048, "kvCacheMemory": "128Mi"},
}


def helm(cluster: ClusterHandle, *args: str) -> str:
    """helm with room for --wait (the cluster handle's default timeout is two minutes)."""
    return cluster.run("helm", *args, timeout=HELM_TIMEOUT_SECONDS + 60).stdout


def install_args(namespace: str, *values: str) -> list[str]:
    return [
        str(CHART),
        "-n",
        namespace,
        "--wait",
        f"--timeout={HELM_TIMEOUT_SECONDS}s",
        *(arg for value in values for arg in ("--set", value)),
    ]


def example_documents() -> list[dict[str, Any]]:
    documents = []
    for path in EXAMPLES:
        for document in yaml.safe_load_all(path.read_text()):
            if not document:
                continue
            if document["kind"] == "LLMPool":
                sizes = TEST_SIZES[document["metadata"]["name"]]
                spec = document["spec"]
                spec["replicas"] = sizes["replicas"]
                spec["maxModelLen"] = sizes["maxModelLen"]
                spec["engine"]["kvCacheMemory"] = sizes["kvCacheMemory"]
                spec.pop("resources", None)  # the local kubelet has no cgroups anyway
            documents.append(document)
    return documents


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (pool.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def wait_pool_ready(cluster: ClusterHandle, namespace: str, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        pool = cluster.get("llmpool", name, "-n", namespace)
        return pool if condition(pool, "Ready").get("status") == "True" else None

    return wait_for(f"LLMPool {name} Ready", probe, ENGINE_START_SECONDS, interval=2)


def release_pods(cluster: ClusterHandle, namespace: str, component: str) -> list[dict[str, Any]]:
    """The release's live pods of one component: operator or gateway."""
    selector = f"{INSTANCE_LABEL},app.kubernetes.io/component={component}"
    pods = cluster.get("pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def operator_pods(cluster: ClusterHandle, namespace: str) -> list[dict[str, Any]]:
    return release_pods(cluster, namespace, "operator")


def chat_on_pod_ip(ip: str, model: str) -> str:
    """One chat completion straight to an engine pod's IP."""
    return chat_on_url(f"http://{ip}:8000/v1", model)


def list_models(base_url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as response:
        return json.loads(response.read())["data"]


def chat_on_url(base_url: str, model: str) -> str:
    """One chat completion through the official openai client.

    Run in a subprocess: the client library stays out of the test process's imports.
    """
    code = (
        "import sys, openai\n"
        "client = openai.OpenAI(base_url=sys.argv[1], api_key='unused', timeout=120)\n"
        "reply = client.chat.completions.create(model=sys.argv[2], max_tokens=8,\n"
        "    messages=[{'role': 'user', 'content': 'Say hello.'}])\n"
        "print(reply.model, reply.choices[0].finish_reason, reply.usage.completion_tokens)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, base_url, model],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def can_i(cluster: ClusterHandle, service_account: str, *args: str) -> bool:
    """`kubectl auth can-i` as the ServiceAccount; exit code 0 means yes, 1 means no."""
    result = cluster.run(
        "kubectl", "auth", "can-i", f"--as=system:serviceaccount:{service_account}", *args,
        check=False,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return result.returncode == 0


def leftovers(cluster: ClusterHandle, namespaces: list[str]) -> list[str]:
    """Everything the release created that is still there ("kind/name")."""
    kinds = "deployments,replicasets,pods,services,serviceaccounts,configmaps,roles,rolebindings"
    found = []
    for namespace in namespaces:
        for kind in (kinds, "kopfpeerings"):
            names = cluster.kubectl(
                "get", kind, "-n", namespace, "-l", INSTANCE_LABEL, "-o", "name"
            ).split()
            found += [f"{namespace}: {name}" for name in names]
    # Cluster-scoped names carry the release namespace (other tests may install "llmpool" too).
    cluster_kinds = "clusterroles,clusterrolebindings,clusterkopfpeerings"
    names = cluster.kubectl("get", cluster_kinds, "-l", INSTANCE_LABEL, "-o", "name").split()
    found += [name for name in names if any(name.endswith(f"-{ns}") for ns in namespaces)]
    return found


@pytest.fixture
def pools_namespace(cluster: ClusterHandle, namespace: str) -> Iterator[str]:
    """A second namespace for the pools: the operator lives in ``namespace`` and serves this."""
    name = f"{namespace}-pools"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        f"serviceaccount default in {name}",
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False),
        30,
    )
    yield name
    cluster.kubectl("delete", "llmpool", "--all", "-n", name, "--wait=false", check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def crds(cluster: ClusterHandle) -> None:
    """The CRDs, as helm would install them from the chart's crds/ (already there is fine)."""
    cluster.kubectl("apply", "-f", str(CHART / "crds"))
    cluster.kubectl("wait", "--for=condition=established", "crd/llmpools.llmpool.dev")


def test_install_serve_upgrade_uninstall(
    cluster: ClusterHandle, namespace: str, pools_namespace: str
) -> None:
    helm(
        cluster,
        "install",
        RELEASE,
        *install_args(
            namespace, f"watchNamespaces={{{pools_namespace}}}", f"engineImage={ENGINE_IMAGE}"
        ),
    )
    try:
        # The operator is a pod of the chart's Deployment, under the chart's ServiceAccount.
        (pod,) = operator_pods(cluster, namespace)
        assert pod_ready(pod)
        assert pod["spec"]["serviceAccountName"] == FULLNAME
        assert f"--namespace={pools_namespace}" in pod["spec"]["containers"][0]["args"]
        # Pools may name only the chart's image repository (ENGINE_IMAGE, the operator's own
        # engine image, is always allowed) and mount no node path.
        assert "--allowed-image=ghcr.io/llmpool/llmpool" in pod["spec"]["containers"][0]["args"]

        cluster.apply(*example_documents(), namespace=pools_namespace)
        with ThreadPoolExecutor(2) as pool_waiters:
            ready = list(
                pool_waiters.map(
                    lambda name: wait_pool_ready(cluster, pools_namespace, name), TEST_SIZES
                )
            )
        for pool in ready:
            name = pool["metadata"]["name"]
            status = pool["status"]
            assert status["readyReplicas"] == TEST_SIZES[name]["replicas"]
            assert status["endpoint"] == f"http://{name}.{pools_namespace}.svc:8000/v1"
            (engine,) = [
                p
                for p in cluster.get("pods", "-n", pools_namespace, "-l", f"{POOL_LABEL}={name}")[
                    "items"
                ]
                if pod_ready(p) and not p["metadata"].get("deletionTimestamp")
            ]
            served_name = pool["spec"]["model"]["servedName"]
            reply = chat_on_pod_ip(engine["status"]["podIP"], served_name)
            assert reply.split()[0] == served_name, reply
        # One base URL serves both pools by model name: the chart's gateway (by pod IP here,
        # as the local cluster routes no Service IP).
        (gateway,) = release_pods(cluster, namespace, "gateway")
        gateway_url = f"http://{gateway['status']['podIP']}:8080/v1"
        served = sorted({pool["spec"]["model"]["servedName"] for pool in ready})
        assert sorted(m["id"] for m in list_models(gateway_url)) == served
        for served_name in served:
            reply = chat_on_url(gateway_url, served_name)
            assert reply.split()[0] == served_name, reply
        # Everything above went through the chart's RBAC: nothing was refused.
        log = cluster.kubectl("logs", "-n", namespace, f"deployment/{FULLNAME}")
        assert "Forbidden" not in log, log
        printed = cluster.kubectl("get", "llmp", "-n", pools_namespace)
        assert "smollm2-chat" in printed and "smollm2-batch" in printed, printed

        # Upgrade with changed values: a new operator pod with the new arguments takes over.
        old_uid = pod["metadata"]["uid"]
        helm(
            cluster, "upgrade", RELEASE,
            *install_args(namespace, "logLevel=verbose", "podAnnotations.llmpool-e2e=upgraded"),
            "--reuse-values",
        )  # fmt: skip
        assert (
            json.loads(helm(cluster, "status", RELEASE, "-n", namespace, "-o", "json"))["version"]
            == 2
        )

        def upgraded_pod_alone() -> list[dict[str, Any]] | None:
            pods = operator_pods(cluster, namespace)
            alone = len(pods) == 1 and pods[0]["metadata"]["uid"] != old_uid
            return pods if alone and pod_ready(pods[0]) else None

        (pod,) = wait_for("the upgraded operator pod alone", upgraded_pod_alone, 120)
        assert "--verbose" in pod["spec"]["containers"][0]["args"]
        assert pod["metadata"]["annotations"]["llmpool-e2e"] == "upgraded"
        # ... and it reconciles: a spec change that rolls nothing is observed.
        cluster.kubectl(
            "patch", "llmpool", "smollm2-batch", "-n", pools_namespace, "--type=merge",
            "-p", '{"spec": {"drift": {"intervalSeconds": 45}}}',
        )  # fmt: skip

        def reconciled() -> bool:
            pool = cluster.get("llmpool", "smollm2-batch", "-n", pools_namespace)
            return pool["status"].get("observedGeneration") == pool["metadata"]["generation"]

        wait_for("the upgraded operator to reconcile the patched pool", reconciled, 120)

        # The operator removes its finalizers while it still runs: delete pools first.
        cluster.run(
            "kubectl", "delete", "llmpool", "--all", "-n", pools_namespace, "--timeout=120s",
            timeout=180,
        )  # fmt: skip
    finally:
        helm(cluster, "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout=120s")

    wait_for(
        "no objects of the release left",
        lambda: not leftovers(cluster, [namespace, pools_namespace]) or None,
        90,
    )
    assert not cluster.kubectl("get", "llmpools,deployments", "-n", pools_namespace, "-o", "name")


@pytest.mark.parametrize("scope", ["namespaced", "clusterwide"])
def test_the_operator_service_account_has_least_privilege(
    cluster: ClusterHandle, namespace: str, crds: None, scope: str
) -> None:
    """What the operator's ServiceAccount may and may not do, asked of the API server.

    No operator runs here (replicaCount=0): only the ServiceAccount and its RBAC matter. The
    cluster-wide variant therefore grants rights in every namespace without acting on any.
    """
    values = ["replicaCount=0", "gateway.replicas=0", "dashboard.enabled=false"]
    if scope == "namespaced":
        values.append(f"watchNamespaces={{{namespace}}}")
    helm(cluster, "install", RELEASE, *install_args(namespace, *values))
    try:
        sa = f"{namespace}:{FULLNAME}"
        served = ["-n", namespace]
        # What it needs, in the namespace it serves.
        for verb, resource in [
            ("watch", "llmpools.llmpool.dev"),
            ("patch", "llmpools.llmpool.dev"),
            ("patch", "deployments.apps"),
            ("patch", "services"),
            ("get", "configmaps"),
            ("delete", "pods"),
            ("create", "events"),
        ]:
            assert can_i(cluster, sa, verb, resource, *served), f"cannot {verb} {resource}"
        assert can_i(cluster, sa, "patch", "llmpools.llmpool.dev", "--subresource=status", *served)
        # Never secrets, never anything it does not manage, never escalation.
        for verb, resource in [
            ("get", "secrets"),
            ("list", "secrets"),
            ("watch", "secrets"),
            ("create", "pods"),
            ("create", "pods/exec"),
            ("delete", "deployments.apps"),
            ("delete", "services"),
            ("delete", "configmaps"),
            ("delete", "llmpools.llmpool.dev"),
            ("update", "llmpools.llmpool.dev"),
            ("create", "roles.rbac.authorization.k8s.io"),
            ("bind", "clusterroles.rbac.authorization.k8s.io"),
            ("impersonate", "serviceaccounts"),
            ("create", "serviceaccounts/token"),
            ("patch", "statefulsets.apps"),
            ("patch", "persistentvolumeclaims"),
        ]:
            assert not can_i(cluster, sa, verb, resource, *served), f"can {verb} {resource}"
        for verb, resource in [
            ("list", "nodes"),
            ("list", "namespaces"),
            ("get", "customresourcedefinitions.apiextensions.k8s.io"),
        ]:
            assert not can_i(cluster, sa, verb, resource), f"can {verb} {resource}"
        elsewhere = can_i(cluster, sa, "watch", "llmpools.llmpool.dev", "-n", "kube-system")
        assert elsewhere == (scope == "clusterwide")
        assert not can_i(cluster, sa, "get", "secrets", "-n", "kube-system")
        # The gateway reads pools and their EndpointSlices, and patches pools only to record
        # held requests (the demand annotation); never their status.
        gateway = f"{namespace}:{FULLNAME}-gateway"
        for verb, resource in [
            ("watch", "llmpools.llmpool.dev"),
            ("patch", "llmpools.llmpool.dev"),
            ("list", "endpointslices"),
        ]:
            assert can_i(cluster, gateway, verb, resource, *served), f"cannot {verb} {resource}"
        status = ["patch", "llmpools.llmpool.dev", "--subresource=status"]
        assert not can_i(cluster, gateway, *status, *served), "the gateway can patch pool status"
        for verb, resource in [
            ("update", "llmpools.llmpool.dev"),
            ("create", "endpointslices"),
            ("get", "secrets"),
            ("list", "pods"),
            ("get", "configmaps"),
        ]:
            assert not can_i(cluster, gateway, verb, resource, *served), f"can {verb} {resource}"
    finally:
        helm(cluster, "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout=120s")
    assert not leftovers(cluster, [namespace])
