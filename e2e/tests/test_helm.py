"""The Helm chart on the real control plane: install, serve both example pools, upgrade, uninstall.

The operator runs as a pod of the project's image under the chart's ServiceAccount, RBAC and
securityContext, so these tests are also the proof that the
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
from typing import Any

import pytest
import yaml
from harness import (
    ENGINE_GEMM_PROBE_PATIENCE,
    IMAGE,
    ROOT,
    ClusterHandle,
    apply_crds,
    create_namespace,
    engine_key,
    event_saying,
    live_pods,
    patch_pool,
    pod_ready,
    run_client_job,
    tamper_template,
    wait_for,
)

pytestmark = pytest.mark.e2e

CHART = ROOT / "charts" / "llmpool"
EXAMPLES = [
    ROOT / "examples" / "smollm2-interactive.yaml",
    ROOT / "examples" / "smollm2-batch.yaml",
]
RELEASE = "llmpool"
FULLNAME = "llmpool"  # the release name contains the chart name (templates/_helpers.tpl)
INSTANCE_LABEL = f"app.kubernetes.io/instance={RELEASE}"
CHAT = "smollm2-chat"
HELM_TIMEOUT_SECONDS = 300
ENGINE_START_SECONDS = 600  # two engines loading the model at once on a busy machine
# The engine image the operator gives pools without spec.image: the one every operator of the
# suite gives them (LLMPOOL_ENGINE_IMAGE), so that an `llmpool operator -A` started by another
# test on a shared cluster (see test_operator.py) renders the same Deployments and the two never
# roll each other's pods.
ENGINE_IMAGE = IMAGE

# The examples as written, made cheap for one busy machine: one replica each, small KV caches
# and CPU requests. Each still has its own maxModelLen, priorityClass and memory limit.
TEST_SIZES = {
    "smollm2-chat": {"replicas": 1, "maxModelLen": 1024, "kvCacheMemory": "64Mi"},
    "smollm2-batch": {"replicas": 1, "maxModelLen": 2048, "kvCacheMemory": "128Mi"},
}
TEST_CPU_REQUEST = "100m"


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
        f"--set=engineGemmProbePatienceSeconds={ENGINE_GEMM_PROBE_PATIENCE}",
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
                # Both pools, the operator, the gateway and CoreDNS on one 2-core node: CPU
                # requests shrink; the memory limits stay (and are enforced: see below).
                spec["resources"]["requests"]["cpu"] = TEST_CPU_REQUEST
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


def apply_examples(cluster: ClusterHandle, namespace: str) -> list[dict[str, Any]]:
    """Apply both examples (at TEST_SIZES) and return the pools once both are Ready."""
    cluster.apply(*example_documents(), namespace=namespace)
    with ThreadPoolExecutor(2) as pool_waiters:
        return list(
            pool_waiters.map(lambda name: wait_pool_ready(cluster, namespace, name), TEST_SIZES)
        )


def delete_pools(cluster: ClusterHandle, namespace: str) -> None:
    """Delete the pools while the operator still runs: it removes their finalizers."""
    cluster.run(
        "kubectl", "delete", "llmpool", "--all", "-n", namespace, "--timeout=120s", timeout=180
    )


def release_pods(cluster: ClusterHandle, namespace: str, component: str) -> list[dict[str, Any]]:
    """The release's live pods of one component: operator or gateway."""
    selector = f"{INSTANCE_LABEL},app.kubernetes.io/component={component}"
    pods = cluster.get("pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def operator_pods(cluster: ClusterHandle, namespace: str) -> list[dict[str, Any]]:
    return release_pods(cluster, namespace, "operator")


def chat_on_pod_ip(ip: str, model: str, key: str) -> str:
    """One chat completion straight to an engine pod's IP."""
    return chat_on_url(f"http://{ip}:8000/v1", model, key)


def list_models(base_url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as response:
        return json.loads(response.read())["data"]


def chat_on_url(base_url: str, model: str, key: str = "unused") -> str:
    """One chat completion through the official openai client.

    Run in a subprocess: the client library stays out of the test process's imports.
    """
    code = (
        "import sys, openai\n"
        "client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[3], timeout=120)\n"
        "reply = client.chat.completions.create(model=sys.argv[2], max_tokens=8,\n"
        "    messages=[{'role': 'user', 'content': 'Say hello.'}])\n"
        "print(reply.model, reply.choices[0].finish_reason, reply.usage.completion_tokens)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, base_url, model, key],
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
    kinds = "deployments,replicasets,pods,services,serviceaccounts,configmaps,secrets,roles,rolebindings"
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
    create_namespace(cluster, name)
    yield name
    cluster.kubectl("delete", "llmpool", "--all", "-n", name, "--wait=false", check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def crds(cluster: ClusterHandle) -> None:
    """The CRDs, as helm would install them from the chart's crds/ (already there is fine)."""
    apply_crds(cluster, CHART / "crds")


def install(cluster: ClusterHandle, namespace: str, *values: str) -> None:
    helm(cluster, "install", RELEASE, *install_args(namespace, *values))


def uninstall(cluster: ClusterHandle, namespace: str) -> None:
    helm(cluster, "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout=120s")


def the_operator_pod_as_the_chart_runs_it(
    cluster: ClusterHandle, namespace: str, pools_namespace: str
) -> dict[str, Any]:
    """The operator is a pod of the chart's Deployment, under the chart's ServiceAccount."""
    (pod,) = operator_pods(cluster, namespace)
    assert pod_ready(pod)
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    assert f"--namespace={pools_namespace}" in pod["spec"]["containers"][0]["args"]
    # Pools may name only the chart's image repository (ENGINE_IMAGE, the operator's own
    # engine image, is always allowed) and mount no node path.
    assert "--allowed-image=ghcr.io/llmpool/llmpool" in pod["spec"]["containers"][0]["args"]
    return pod


def engines_answer_only_the_fleet(
    cluster: ClusterHandle, pools_namespace: str, ready: list[dict[str, Any]]
) -> None:
    """Each Ready pool's engine answers with the pool's key, and refuses a call without it."""
    for pool in ready:
        name = pool["metadata"]["name"]
        status = pool["status"]
        assert status["readyReplicas"] == TEST_SIZES[name]["replicas"]
        assert status["endpoint"] == f"http://{name}.{pools_namespace}.svc:8000/v1"
        (engine,) = ready_engines(cluster, pools_namespace, name)
        served_name = pool["spec"]["model"]["servedName"]
        key = engine_key(cluster, pools_namespace, name)
        reply = chat_on_pod_ip(engine["status"]["podIP"], served_name, key)
        # Engines answer only the fleet: without the pool's key, a direct call is refused.
        with pytest.raises(AssertionError, match="401"):
            chat_on_pod_ip(engine["status"]["podIP"], served_name, "unused")
        assert reply.split()[0] == served_name, reply


def the_gateway_serves_both_pools(
    cluster: ClusterHandle, namespace: str, ready: list[dict[str, Any]]
) -> None:
    """One base URL serves both pools by model name: the chart's gateway, by its Service."""
    gateway = cluster.get("service", "llmpool-gateway", "-n", namespace)
    gateway_url = f"http://{gateway['spec']['clusterIP']}:8080/v1"
    served = sorted({pool["spec"]["model"]["servedName"] for pool in ready})
    assert sorted(m["id"] for m in list_models(gateway_url)) == served
    for served_name in served:
        reply = chat_on_url(gateway_url, served_name)
        assert reply.split()[0] == served_name, reply


def an_upgrade_takes_over(
    cluster: ClusterHandle, namespace: str, pools_namespace: str, old_uid: str
) -> None:
    """Upgrade with changed values: a new operator pod with the new arguments takes over."""
    helm(
        cluster, "upgrade", RELEASE,
        *install_args(namespace, "logLevel=verbose", "podAnnotations.llmpool-e2e=upgraded"),
        "--reuse-values",
    )  # fmt: skip
    assert (
        json.loads(helm(cluster, "status", RELEASE, "-n", namespace, "-o", "json"))["version"] == 2
    )

    def upgraded_pod_alone() -> list[dict[str, Any]] | None:
        pods = operator_pods(cluster, namespace)
        alone = len(pods) == 1 and pods[0]["metadata"]["uid"] != old_uid
        return pods if alone and pod_ready(pods[0]) else None

    (pod,) = wait_for("the upgraded operator pod alone", upgraded_pod_alone, 120)
    assert "--verbose" in pod["spec"]["containers"][0]["args"]
    assert pod["metadata"]["annotations"]["llmpool-e2e"] == "upgraded"
    # ... and it reconciles: a spec change that rolls nothing is observed.
    patch_pool(cluster, pools_namespace, "smollm2-batch", {"drift": {"intervalSeconds": 45}})

    def reconciled() -> bool:
        pool = cluster.get("llmpool", "smollm2-batch", "-n", pools_namespace)
        return pool["status"].get("observedGeneration") == pool["metadata"]["generation"]

    wait_for("the upgraded operator to reconcile the patched pool", reconciled, 120)


def test_install_serve_upgrade_uninstall(
    cluster: ClusterHandle, namespace: str, pools_namespace: str
) -> None:
    install(
        cluster, namespace, f"watchNamespaces={{{pools_namespace}}}", f"engineImage={ENGINE_IMAGE}"
    )
    try:
        pod = the_operator_pod_as_the_chart_runs_it(cluster, namespace, pools_namespace)
        ready = apply_examples(cluster, pools_namespace)
        engines_answer_only_the_fleet(cluster, pools_namespace, ready)
        the_gateway_serves_both_pools(cluster, namespace, ready)
        # Everything above went through the chart's RBAC: nothing was refused.
        log = cluster.kubectl("logs", "-n", namespace, f"deployment/{FULLNAME}")
        assert "Forbidden" not in log, log
        printed = cluster.kubectl("get", "llmp", "-n", pools_namespace)
        assert "smollm2-chat" in printed and "smollm2-batch" in printed, printed
        an_upgrade_takes_over(cluster, namespace, pools_namespace, pod["metadata"]["uid"])
        delete_pools(cluster, pools_namespace)
    finally:
        uninstall(cluster, namespace)

    wait_for(
        "no objects of the release left",
        lambda: not leftovers(cluster, [namespace, pools_namespace]) or None,
        90,
    )
    assert not cluster.kubectl("get", "llmpools,deployments", "-n", pools_namespace, "-o", "name")


def engine_requests(pod: dict[str, Any]) -> float:
    """Requests an engine pod finished, from its /metrics (by pod IP, from the host)."""
    url = f"http://{pod['status']['podIP']}:8000/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("llmpool:request_success_total{")
    )


def ready_engines(cluster: ClusterHandle, namespace: str, pool: str) -> list[dict[str, Any]]:
    return [p for p in live_pods(cluster, namespace, pool) if pod_ready(p)]


def exec_in(cluster: ClusterHandle, namespace: str, pod: str, script: str) -> str:
    return cluster.kubectl("exec", pod, "-n", namespace, "--", "sh", "-c", script)


WRITE_TO_ROOT = "touch /written 2>&1 && echo writable || true"


def endpoints_answer_from_a_pod(
    cluster: ClusterHandle, pools_namespace: str, ready: list[dict[str, Any]]
) -> None:
    """status.endpoint, as a client pod sees it: CoreDNS, then the ClusterIP, then a replica."""
    for pool in ready:
        name, served = pool["metadata"]["name"], pool["spec"]["model"]["servedName"]
        endpoint = pool["status"]["endpoint"]
        assert endpoint == f"http://{name}.{pools_namespace}.svc:8000/v1"
        logs = run_client_job(
            cluster, pools_namespace, f"client-{name}", name, endpoint, served, "1"
        )
        assert logs.split()[0] == served, logs


def a_scaled_pool_spreads(cluster: ClusterHandle, pools_namespace: str) -> list[dict[str, Any]]:
    """Scaled to 2, the chat pool's Service spreads one client's requests over both replicas
    (returned)."""
    cluster.kubectl("scale", "llmpool", CHAT, "--replicas=2", "-n", pools_namespace)
    wait_for(
        "two ready chat replicas",
        lambda: len(ready_engines(cluster, pools_namespace, CHAT)) == 2 or None,
        ENGINE_START_SECONDS,
        interval=2,
    )
    wait_pool_ready(cluster, pools_namespace, CHAT)
    engines = ready_engines(cluster, pools_namespace, CHAT)
    before = {p["metadata"]["name"]: engine_requests(p) for p in engines}
    requests = 12  # all on one replica by chance: 2 * 2**-12
    endpoint = f"http://{CHAT}.{pools_namespace}.svc:8000/v1"
    run_client_job(
        cluster, pools_namespace, "client-spread", CHAT, endpoint, "smollm2", str(requests)
    )
    served_by = {
        p["metadata"]["name"]: engine_requests(p) - before[p["metadata"]["name"]] for p in engines
    }
    assert sum(served_by.values()) == requests, served_by
    assert all(count >= 1 for count in served_by.values()), served_by
    return engines


def security_contexts_hold(
    cluster: ClusterHandle, namespace: str, pools_namespace: str, engine: str
) -> None:
    """The chart's and the operator's securityContexts hold on the node: uid 10001, a read-only
    root filesystem, and the engine's memory limit in its cgroup."""
    (operator,) = operator_pods(cluster, namespace)
    operator_name = operator["metadata"]["name"]
    assert exec_in(cluster, namespace, operator_name, "id -u").strip() == "10001"
    assert "Read-only file system" in exec_in(cluster, namespace, operator_name, WRITE_TO_ROOT)
    assert exec_in(cluster, pools_namespace, engine, "id -u").strip() == "10001"
    assert "Read-only file system" in exec_in(cluster, pools_namespace, engine, WRITE_TO_ROOT)
    limit = exec_in(
        cluster, pools_namespace, engine,
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null"
        " || cat /sys/fs/cgroup/memory.max",
    )  # fmt: skip
    assert int(limit) == 2 * 2**30  # the chat example's limits.memory: 2Gi


def the_operator_pod_heals_drift(
    cluster: ClusterHandle, namespace: str, pools_namespace: str, before: list[str]
) -> None:
    """With the operator pod away, the template every replica mounts is changed and one replica
    (the first of ``before``) restarted on it; the operator pod, back, checks every replica's
    /fingerprint over the pod network, reports the drift and recreates the replica."""
    cluster.kubectl("scale", f"deployment/{FULLNAME}", "--replicas=0", "-n", namespace)
    wait_for("no operator pod", lambda: not operator_pods(cluster, namespace) or None, 90)
    tamper_template(cluster, pools_namespace, CHAT)
    victim = sorted(before)[0]
    cluster.kubectl("delete", "pod", victim, "-n", pools_namespace)

    def replacement() -> str | None:
        new = [
            p["metadata"]["name"]
            for p in ready_engines(cluster, pools_namespace, CHAT)
            if p["metadata"]["name"] not in before
        ]
        return new[0] if new else None

    drifted = wait_for("the replacement replica", replacement, ENGINE_START_SECONDS, 2)
    cluster.kubectl("scale", f"deployment/{FULLNAME}", "--replicas=1", "-n", namespace)

    def healed() -> dict[str, Any] | None:
        pool = cluster.get("llmpool", CHAT, "-n", pools_namespace)
        names = {p["metadata"]["name"] for p in ready_engines(cluster, pools_namespace, CHAT)}
        done = (
            drifted not in names
            and len(names) == 2
            and condition(pool, "Drifted").get("status") == "False"
            and condition(pool, "Ready").get("status") == "True"
        )
        return pool if done else None

    pool = wait_for("the drifted replica recreated", healed, ENGINE_START_SECONDS, 2)
    assert pool["status"]["drift"] == []
    for reason in ("DriftDetected", "RecreatingDriftedPod"):
        event_saying(cluster, pools_namespace, reason, drifted)


def test_in_cluster_endpoint_scaling_security_and_drift(
    cluster: ClusterHandle, namespace: str, pools_namespace: str
) -> None:
    """What a user of the chart meets: each pool's ``status.endpoint`` answers by its DNS name
    from a pod; a scaled pool's Service spreads requests; the pods run as the chart says; and
    the operator pod finds and heals a drifted replica over the pod network."""
    install(cluster, namespace, f"watchNamespaces={{{pools_namespace}}}", f"engineImage={IMAGE}")
    try:
        ready = apply_examples(cluster, pools_namespace)
        endpoints_answer_from_a_pod(cluster, pools_namespace, ready)
        engines = a_scaled_pool_spreads(cluster, pools_namespace)
        engine = engines[0]["metadata"]["name"]
        security_contexts_hold(cluster, namespace, pools_namespace, engine)
        names = [p["metadata"]["name"] for p in engines]
        the_operator_pod_heals_drift(cluster, namespace, pools_namespace, names)
        delete_pools(cluster, pools_namespace)
    finally:
        uninstall(cluster, namespace)


# What the operator's ServiceAccount needs in the namespace it serves: (verb, resource).
OPERATOR_NEEDS = [
    ("watch", "llmpools.llmpool.dev"),
    ("patch", "llmpools.llmpool.dev"),
    ("patch", "deployments.apps"),
    ("patch", "services"),
    ("get", "configmaps"),
    ("patch", "poddisruptionbudgets.policy"),
    ("patch", "pods"),
    ("delete", "pods"),
    ("create", "events"),
    # Each pool's engine-key Secret, and its LLMPoolDemand.
    ("get", "secrets"),
    ("patch", "secrets"),
    ("watch", "llmpooldemands.llmpool.dev"),
    ("patch", "llmpooldemands.llmpool.dev"),
]
# Never a Secret deleted, never anything it does not manage, never escalation.
OPERATOR_NEVER = [
    ("delete", "secrets"),
    ("create", "pods"),
    ("create", "pods/exec"),
    ("delete", "deployments.apps"),
    ("delete", "services"),
    ("delete", "configmaps"),
    ("delete", "poddisruptionbudgets.policy"),
    ("delete", "llmpools.llmpool.dev"),
    ("update", "llmpools.llmpool.dev"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("bind", "clusterroles.rbac.authorization.k8s.io"),
    ("impersonate", "serviceaccounts"),
    ("create", "serviceaccounts/token"),
    ("patch", "statefulsets.apps"),
    ("patch", "persistentvolumeclaims"),
]
OPERATOR_NEVER_CLUSTER_WIDE = [
    ("list", "nodes"),
    ("list", "namespaces"),
    ("get", "customresourcedefinitions.apiextensions.k8s.io"),
]
# The gateway reads pools and their EndpointSlices, and records held requests in the status of
# LLMPoolDemands only: it can change no pool, no spec.
GATEWAY_NEEDS = [
    ("watch", "llmpools.llmpool.dev"),
    ("list", "endpointslices"),
]
GATEWAY_NEVER = [
    ("patch", "llmpools.llmpool.dev"),
    ("patch", "llmpooldemands.llmpool.dev"),
    ("create", "llmpooldemands.llmpool.dev"),
    ("update", "llmpools.llmpool.dev"),
    ("create", "endpointslices"),
    ("get", "secrets"),
    ("list", "pods"),
    ("get", "configmaps"),
]


def operator_rights(cluster: ClusterHandle, namespace: str, scope: str) -> None:
    """What the operator's ServiceAccount may and may not do (``scope``: where it may)."""
    sa = f"{namespace}:{FULLNAME}"
    served = ["-n", namespace]
    for verb, resource in OPERATOR_NEEDS:
        assert can_i(cluster, sa, verb, resource, *served), f"cannot {verb} {resource}"
    assert can_i(cluster, sa, "patch", "llmpools.llmpool.dev", "--subresource=status", *served)
    for verb, resource in OPERATOR_NEVER:
        assert not can_i(cluster, sa, verb, resource, *served), f"can {verb} {resource}"
    for verb, resource in OPERATOR_NEVER_CLUSTER_WIDE:
        assert not can_i(cluster, sa, verb, resource), f"can {verb} {resource}"
    elsewhere = can_i(cluster, sa, "watch", "llmpools.llmpool.dev", "-n", "kube-system")
    assert elsewhere == (scope == "clusterwide")
    in_kube_system = can_i(cluster, sa, "get", "secrets", "-n", "kube-system")
    assert in_kube_system == (scope == "clusterwide")


def gateway_rights(cluster: ClusterHandle, namespace: str) -> None:
    """What the gateway's ServiceAccount may and may not do in the namespace it serves."""
    gateway = f"{namespace}:{FULLNAME}-gateway"
    served = ["-n", namespace]
    for verb, resource in GATEWAY_NEEDS:
        assert can_i(cluster, gateway, verb, resource, *served), f"cannot {verb} {resource}"
    demand = ["patch", "llmpooldemands.llmpool.dev", "--subresource=status"]
    assert can_i(cluster, gateway, *demand, *served), "the gateway cannot record demand"
    status = ["patch", "llmpools.llmpool.dev", "--subresource=status"]
    assert not can_i(cluster, gateway, *status, *served), "the gateway can patch pool status"
    for verb, resource in GATEWAY_NEVER:
        assert not can_i(cluster, gateway, verb, resource, *served), f"can {verb} {resource}"


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
    install(cluster, namespace, *values)
    try:
        operator_rights(cluster, namespace, scope)
        gateway_rights(cluster, namespace)
    finally:
        uninstall(cluster, namespace)
    assert not leftovers(cluster, [namespace])
