"""The LLMPool operator on the real control plane: reconcile, status, rollouts, drift, clean-up.

The operator runs as a local process against the cluster (as a developer would run it); it
reaches engine pods by pod IP, as it does in a cluster. Tests that need engines to serve are
skipped until `llmpool serve` exists.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import (
    ENGINE_START_SECONDS,
    ROOT,
    TAMPERED_TEMPLATE,
    ClusterHandle,
    OperatorProcess,
    apply_crds,
    condition,
    event_saying,
    live_pods,
    patch_pool,
    pod_ready,
    pool_status,
    tamper_template,
    wait_for,
    wait_pool_ready,
)

from llmpool.engine import model_source
from tests.conftest import readable_by_all, write_tiny_checkpoint

pytestmark = pytest.mark.e2e

INTERACTIVE = ROOT / "examples" / "smollm2-interactive.yaml"
DIGEST_ANNOTATION = "llmpool.dev/pinned-digest"
POOL_LABEL = "llmpool.dev/pool"
POOL = "smollm2-chat"
DRIFT_INTERVAL_SECONDS = 5
# The operator's timer runs every 2 s and waits 5 s after its own last apply before it trusts
# its watch caches to show a child missing or different; restoring takes at most that, plus
# polling and kubectl slack.
RESTORE_SECONDS = 2 * 2 + 5 + 15


@pytest.fixture(scope="module")
def operator(
    cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(cluster, log_path, "-A", "--standalone")
    process.start()
    yield process
    # Pools carry the operator's finalizer: remove them while the operator still runs, or the
    # test namespaces would hang in Terminating.
    cluster.run("kubectl", "delete", "llmpools", "--all", "-A", "--timeout=120s", check=False)
    process.stop()
    print(f"operator log: {process.log_path}")


def engine_available() -> bool:
    """Whether `llmpool serve` exists yet (the engine's HTTP server)."""
    probe = subprocess.run(
        [sys.executable, "-m", "llmpool.cli", "serve", "--help"], capture_output=True, timeout=120
    )
    return probe.returncode == 0


needs_engine = pytest.mark.skipif(not engine_available(), reason="`llmpool serve` is not there yet")


def example(revision: str | None = None, **spec: Any) -> list[dict[str, Any]]:
    """The interactive example's documents, ``spec`` set in the pool's spec."""
    documents = [d for d in yaml.safe_load_all(INTERACTIVE.read_text()) if d]
    pool = next(d for d in documents if d["kind"] == "LLMPool")
    pool["spec"].update(spec)
    if revision is not None:
        pool["spec"]["model"]["revision"] = revision
    return documents


def serving_pool(cluster: ClusterHandle, namespace: str, **spec: Any) -> dict[str, Any]:
    """Apply the example (``spec`` set in the pool's spec); its status once Ready."""
    cluster.apply(*example(**spec), namespace=namespace)
    return wait_pool_ready(cluster, namespace, POOL)


def wait_digest(cluster: ClusterHandle, namespace: str) -> str:
    """The pool's first pinned digest, once the operator wrote it."""
    return wait_for(
        "a digest", lambda: pool_status(cluster, namespace, POOL).get("pinnedDigest"), 60
    )


def chat(ip: str, model: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{ip}:8000/v1/chat/completions",
        data=json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def owned_by(obj: dict[str, Any], owner_uid: str) -> bool:
    return any(
        ref["uid"] == owner_uid and ref.get("controller")
        for ref in obj["metadata"].get("ownerReferences", [])
    )


# --------------------------------------------------------------------------- API server


BAD_SPECS = {
    "bad enum": ({"quantization": "int3"}, 'Unsupported value: "int3"'),
    "maxModelLen above the model's context": ({"maxModelLen": 16384}, "at most 8192"),
    "missing revision": (
        {"model": {"source": "builtin://smollm2-135m-instruct"}},
        "spec.model.revision: Required value",
    ),
    "malformed revision": (
        {"model": {"source": "builtin://smollm2-135m-instruct", "revision": "sha256:abc"}},
        "spec.model.revision",
    ),
    "hf:// without a commit": (
        {"model": {"source": "hf://org/name", "revision": "sha256:" + "a" * 64}},
        "40-hex commit SHA",
    ),
    "replicas and autoscaling": (
        {"autoscaling": {"maxReplicas": 3}},
        "set either replicas or autoscaling, not both",
    ),
    "minReplicas above maxReplicas": (
        {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        "minReplicas must be at most maxReplicas",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_invalid_specs_are_rejected(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str, case: str
) -> None:
    change, message = BAD_SPECS[case]
    pool = example(**change)[1]
    result = cluster.run(
        "kubectl", "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(pool), check=False
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# --------------------------------------------------------------------- without engines
# These tests check the operator's objects, not serving: their pools' pods wait Pending for a
# node label no node has, so that no engine starts (loads the model, probes its GEMMs) on the
# node's 2 cores beside the tests that do serve, only to be deleted with the namespace.
NO_NODE = {"nodeSelector": {"llmpool.dev/e2e-no-such-node": "true"}}


def test_children_are_owned_and_deleted_with_the_pool(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(*example(**NO_NODE), namespace=namespace)
    pool = cluster.get("llmpool", POOL, "-n", namespace)
    uid = pool["metadata"]["uid"]
    children = [
        ("deployment", POOL),
        ("service", POOL),
        ("configmap", "smollm2-chat-engine"),
        ("poddisruptionbudget", POOL),
    ]
    for kind, name in children:
        found = wait_for(
            f"{kind} {name}",
            lambda k=kind, n=name: (
                cluster.run(
                    "kubectl", "get", k, n, "-n", namespace, "-o", "json", check=False
                ).stdout
            ),
            60,
        )
        assert owned_by(json.loads(found), uid), f"{kind} {name} is not owned by the pool"
    status = wait_for(
        "status.pinnedDigest",
        lambda: (
            pool_status(cluster, namespace, POOL).get("pinnedDigest")
            and pool_status(cluster, namespace, POOL)
        ),
        60,
    )
    assert status["endpoint"] == f"http://smollm2-chat.{namespace}.svc:8000/v1"
    assert status["capacity"]["kvBytesPerToken"] > 0
    template = cluster.get("deployment", POOL, "-n", namespace)["spec"]["template"]
    assert template["metadata"]["annotations"][DIGEST_ANNOTATION] == status["pinnedDigest"]

    cluster.kubectl("delete", "llmpool", POOL, "-n", namespace, "--wait=true", "--timeout=60s")
    for kind, name in children:
        wait_for(
            f"{kind} {name} to be collected",
            lambda k=kind, n=name: (
                cluster.run("kubectl", "get", k, n, "-n", namespace, check=False).returncode != 0
            ),
            90,
        )
    wait_for("engine pods to go", lambda: live_pods(cluster, namespace, POOL) == [], 120)


def test_scale_does_not_roll_and_a_pinned_change_does(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(*example(**NO_NODE), namespace=namespace)
    first = wait_digest(cluster, namespace)

    cluster.kubectl("scale", "llmpool", POOL, "-n", namespace, "--replicas=3")
    wait_for(
        "the Deployment to scale",
        lambda: cluster.get("deployment", POOL, "-n", namespace)["spec"]["replicas"] == 3,
        60,
    )
    deployment = cluster.get("deployment", POOL, "-n", namespace)
    assert deployment["spec"]["template"]["metadata"]["annotations"][DIGEST_ANNOTATION] == first
    assert pool_status(cluster, namespace, POOL)["pinnedDigest"] == first
    replica_sets = cluster.get("replicasets", "-n", namespace, "-l", f"{POOL_LABEL}=smollm2-chat")[
        "items"
    ]
    assert len(replica_sets) == 1, "scaling created a new ReplicaSet"
    event_saying(cluster, namespace, "Scaled", "replicas 2 -> 3")

    patch_pool(cluster, namespace, POOL, {"maxModelLen": 4096})
    second = wait_for(
        "a new digest",
        lambda: (d := pool_status(cluster, namespace, POOL).get("pinnedDigest")) != first and d,
        60,
    )
    annotations = cluster.get("deployment", POOL, "-n", namespace)["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert annotations[DIGEST_ANNOTATION] == second
    event_saying(cluster, namespace, "RolloutStarted", "maxModelLen")


def test_a_deleted_deployment_is_restored(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(*example(**NO_NODE), namespace=namespace)
    digest = wait_digest(cluster, namespace)
    wait_for(
        "the Deployment",
        lambda: (
            cluster.run(
                "kubectl", "get", "deployment", POOL, "-n", namespace, check=False
            ).returncode
            == 0
        ),
        60,
    )
    old_uid = cluster.get("deployment", POOL, "-n", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", POOL, "-n", namespace)

    def restored() -> dict[str, Any] | None:
        found = cluster.run(
            "kubectl",
            "get",
            "deployment",
            POOL,
            "-n",
            namespace,
            "-o",
            "json",
            check=False,
        )
        deployment = json.loads(found.stdout) if found.returncode == 0 else None
        return deployment if deployment and deployment["metadata"]["uid"] != old_uid else None

    deployment = wait_for("the Deployment to be restored", restored, 60)
    assert deployment["spec"]["template"]["metadata"]["annotations"][DIGEST_ANNOTATION] == digest
    event_saying(cluster, namespace, "DeploymentRestored", POOL)


def child_uid(cluster: ClusterHandle, namespace: str, kind: str, name: str) -> str | None:
    found = cluster.run("kubectl", "get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(found.stdout)["metadata"]["uid"] if found.returncode == 0 else None


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("service", POOL),
        ("configmap", "smollm2-chat-engine"),
        ("poddisruptionbudget", POOL),
    ],
)
def test_a_deleted_service_or_configmap_is_restored(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str, kind: str, name: str
) -> None:
    cluster.apply(*example(**NO_NODE), namespace=namespace)
    old_uid = wait_for(f"the {kind}", lambda: child_uid(cluster, namespace, kind, name), 60)
    cluster.kubectl("delete", kind, name, "-n", namespace)

    def restored() -> str | None:
        uid = child_uid(cluster, namespace, kind, name)
        return uid if uid not in (None, old_uid) else None

    wait_for(f"the {kind} to be restored", restored, RESTORE_SECONDS, interval=0.5)
    reason = {
        "service": "ServiceRestored",
        "configmap": "ConfigMapRestored",
        "poddisruptionbudget": "PodDisruptionBudgetRestored",
    }[kind]
    event_saying(cluster, namespace, reason, f"{name} was missing")


def test_a_hand_edited_deployment_is_restored(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(*example(**NO_NODE), namespace=namespace)
    digest = wait_digest(cluster, namespace)
    wait_for("the Deployment", lambda: child_uid(cluster, namespace, "deployment", POOL), 60)

    def args() -> list[str]:
        deployment = cluster.get("deployment", POOL, "-n", namespace)
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    rendered = args()
    index = rendered.index("--max-model-len") + 1
    edit = [
        {"op": "replace", "path": f"/spec/template/spec/containers/0/args/{index}", "value": "64"}
    ]
    cluster.kubectl(
        "patch", "deployment", POOL, "-n", namespace, "--type=json",
        "-p", json.dumps(edit),
    )  # fmt: skip
    assert args()[index] == "64"

    wait_for(
        "the arguments to be restored", lambda: args() == rendered, RESTORE_SECONDS, interval=0.5
    )
    event_saying(cluster, namespace, "DeploymentRestored", "differed at")
    assert pool_status(cluster, namespace, POOL)["pinnedDigest"] == digest


def test_a_child_the_api_server_rejects_is_named_in_the_status(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    # Valid for the CRD, invalid for a Deployment: the request exceeds the limit.
    resources = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
    cluster.apply(*example(resources=resources, **NO_NODE), namespace=namespace)

    def rejected() -> dict[str, Any] | None:
        found = condition(pool_status(cluster, namespace, POOL), "Degraded")
        return found if found.get("reason") == "ApplyRejected" else None

    degraded = wait_for("Degraded ApplyRejected", rejected, 60)
    assert degraded["status"] == "True"
    assert "Deployment smollm2-chat" in degraded["message"]
    assert "less than or equal to cpu limit" in degraded["message"]
    ready = condition(pool_status(cluster, namespace, POOL), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyRejected")
    event_saying(cluster, namespace, "ApplyRejected", POOL)

    # Fixing the spec clears it.
    cluster.kubectl(
        "patch", "llmpool", POOL, "-n", namespace, "--type=json",
        "-p", '[{"op": "remove", "path": "/spec/resources"}]',
    )  # fmt: skip
    wait_for(
        "the Deployment",
        lambda: child_uid(cluster, namespace, "deployment", POOL),
        60,
    )
    wait_for("ApplyRejected to clear", lambda: not rejected(), 60)


REFUSED = {
    "image": ({"image": "docker.io/library/python:3"}, "ImageNotAllowed"),
    "host path": (
        {"model": {"source": "file:///etc", "revision": "sha256:" + "1" * 64}},
        "HostPathNotAllowed",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_disallowed_image_or_host_path_is_refused(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str, case: str
) -> None:
    change, reason = REFUSED[case]
    cluster.apply(*example(**change), namespace=namespace)

    def refused() -> dict[str, Any] | None:
        found = condition(pool_status(cluster, namespace, POOL), "Ready")
        return found if found.get("reason") == reason else None

    ready = wait_for(f"Ready=False {reason}", refused, 60)
    assert ready["status"] == "False"
    assert "not allow" in ready["message"]
    event_saying(cluster, namespace, reason, POOL)
    selector = f"{POOL_LABEL}=smollm2-chat"
    for kind in ("deployments", "services", "configmaps", "pods"):
        assert cluster.get(kind, "-n", namespace, "-l", selector)["items"] == [], kind


def test_operator_restart_converges_without_duplicates(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(*example(**NO_NODE), namespace=namespace)
    wait_digest(cluster, namespace)
    # Kill the operator hard right after a spec change, before it can finish reconciling.
    patch_pool(cluster, namespace, POOL, {"maxModelLen": 3072})
    operator.stop(signal.SIGKILL)
    operator.start()

    def converged() -> bool:
        pool = cluster.get("llmpool", POOL, "-n", namespace)
        status = pool.get("status") or {}
        deployment = cluster.get("deployment", POOL, "-n", namespace)
        return (
            status.get("observedGeneration") == pool["metadata"]["generation"]
            and status.get("pinned", {}).get("maxModelLen") == 3072
            and deployment["spec"]["template"]["metadata"]["annotations"][DIGEST_ANNOTATION]
            == status["pinnedDigest"]
        )

    wait_for("the restarted operator to converge", converged, 90, interval=1)
    selector = f"{POOL_LABEL}=smollm2-chat"
    for kind in ("deployments", "services", "configmaps"):
        assert len(cluster.get(kind, "-n", namespace, "-l", selector)["items"]) == 1, kind


def test_peered_replicas_do_not_fight(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> None:
    """Two peered operators: the higher priority acts, the other waits, then takes over."""
    operator.stop()  # the shared standalone operator would act regardless of peering
    high = OperatorProcess(cluster, tmp_path / "high.log", "-n", namespace, "--priority", "200")
    low = OperatorProcess(cluster, tmp_path / "low.log", "-n", namespace, "--priority", "100")
    try:
        high.start()
        low.start()
        wait_for(
            "the lower replica to pause", lambda: "Pausing operations in favour of" in low.log(), 60
        )
        cluster.apply(*example(**NO_NODE), namespace=namespace)
        wait_digest(cluster, namespace)
        # The status is patched inside the handler, so its success line may follow the digest.
        wait_for(
            "the higher replica's handler to finish",
            lambda: "Handler 'reconcile' succeeded" in high.log(),
            30,
        )
        assert "Handler 'reconcile' succeeded" not in low.log()

        high.stop()
        wait_for("the lower replica to resume", lambda: "Resuming operations" in low.log(), 90)
        patch_pool(cluster, namespace, POOL, {"maxModelLen": 1024})
        wait_for(
            "the remaining replica to reconcile",
            lambda: (
                pool_status(cluster, namespace, POOL).get("pinned", {}).get("maxModelLen") == 1024
            ),
            60,
        )
    finally:
        high.stop()
        low.stop()
        operator.start()


# ------------------------------------------------------------------------ with engines


@needs_engine
def test_sample_pool_serves_and_reports_ready(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    status = serving_pool(cluster, namespace)
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
    assert status["endpoint"] == f"http://smollm2-chat.{namespace}.svc:8000/v1"
    pods = live_pods(cluster, namespace, POOL)
    assert len(pods) == 2 and all(pod_ready(p) for p in pods)
    for pod in pods:
        reply = chat(pod["status"]["podIP"], "smollm2")
        assert reply["choices"][0]["message"]["role"] == "assistant"
    table = cluster.kubectl("get", "llmp", POOL, "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "READY",
        "REPLICAS",
        "MODEL",
        "REVISION",
        "MAXLEN",
        "QUANT",
        "DRIFTED",
        "AGE",
    ]
    assert row.split()[1:8] == [
        "True",
        "2/2",
        "builtin://smollm2-135m-instruct",
        status["shortRevision"],
        "2048",
        "none",
        "False",
    ]


@pytest.fixture
def tiny_model() -> Iterator[Path]:
    """The unit tests' tiny model (the built-in shapes, 2 of 30 layers; tests/conftest.py) in a
    node folder the engine pods (uid 10001) can read: ``<prefix>/tiny``, yielded."""
    prefix = Path(tempfile.mkdtemp(prefix="llmpool-e2e-models-"))
    try:
        prefix.chmod(0o755)
        yield readable_by_all(
            write_tiny_checkpoint(prefix / "tiny", model_source.resolve(None).folder)
        )
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


@needs_engine
def test_a_compiled_pool_serves_while_it_compiles_then_runs_compiled(
    operator: OperatorProcess,
    cluster: ClusterHandle,
    namespace: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """``engine.compile``: the replica turns Ready and serves eager while it compiles every batch
    size in the background (inductor, with the image's g++, its kernels under the pod's /tmp on
    a read-only root), then says in its log and /fingerprint that it runs compiled.

    The pool serves the tiny model from a node path (file://): inductor compiles 2 layers, not
    the built-in model's 30 (minutes of the node's 2 cores), and what is checked is the pool's
    compile setting and the pod's compiler and /tmp. An operator of this namespace that allows
    that path stands in for the suite's, which refuses node paths."""
    model = {
        "source": f"file://{tiny_model}",
        "revision": model_source.resolve(str(tiny_model)).revision,
        "servedName": "smollm2",
    }
    documents = example(model=model)
    spec = documents[1]["spec"]
    spec["replicas"] = 1
    spec["engine"] = {**spec["engine"], "compile": True, "maxNumBatchedTokens": 64}
    spec["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    operator.stop()
    allowing = OperatorProcess(
        cluster, tmp_path / "operator.log", "-n", namespace, "--standalone",
        "--allow-host-path-models", f"--allowed-host-path-prefix={tiny_model.parent}",
    )  # fmt: skip
    try:
        allowing.start()
        cluster.apply(*documents, namespace=namespace)
        compiled_replica_serves(cluster, namespace)
        cluster.kubectl("delete", "llmpool", POOL, "-n", namespace, "--timeout=120s")
    finally:
        allowing.stop()
        operator.start()


def compiled_replica_serves(cluster: ClusterHandle, namespace: str) -> None:
    """The compiled pool's one replica serves eager, then compiled (see the test above)."""
    wait_pool_ready(cluster, namespace, POOL)
    (pod,) = live_pods(cluster, namespace, POOL)
    assert "--compile" in pod["spec"]["containers"][0]["args"]
    ip = pod["status"]["podIP"]
    reply = chat(ip, "smollm2")
    assert reply["choices"][0]["message"]["role"] == "assistant"

    def compile_report() -> dict[str, Any] | None:
        with urllib.request.urlopen(f"http://{ip}:8000/fingerprint", timeout=60) as response:
            report = json.loads(response.read())["observed"]["compile"]
        assert report["state"] != "failed", report
        return report if report["state"] == "compiled" else None

    report = wait_for("the compiled decoder", compile_report, ENGINE_START_SECONDS, interval=5)
    assert report["enabled"] and report["cache"] in ("hit", "miss")
    assert chat(ip, "smollm2")["choices"][0]["message"]["role"] == "assistant"
    logs = cluster.kubectl("logs", pod["metadata"]["name"], "-n", namespace, "-c", "engine")
    assert "compiling the decoder while serving eager" in logs
    assert "compiled the decoder" in logs


@needs_engine
def test_rollout_reports_ready_only_when_finished_and_raises_no_drift(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    serving_pool(cluster, namespace)
    patch_pool(cluster, namespace, POOL, {"maxModelLen": 4096})
    deadline = time.monotonic() + ENGINE_START_SECONDS
    seen_not_ready = False
    while time.monotonic() < deadline:
        time.sleep(0.5)
        pool = cluster.get("llmpool", POOL, "-n", namespace)
        status = pool.get("status") or {}
        assert condition(status, "Drifted").get("status") != "True", status.get("drift")
        if status.get("observedGeneration") != pool["metadata"]["generation"]:
            continue
        if condition(status, "Ready").get("status") != "True":
            seen_not_ready = True
        elif seen_not_ready:
            pods = live_pods(cluster, namespace, POOL)
            digests = {p["metadata"]["annotations"][DIGEST_ANNOTATION] for p in pods}
            assert digests == {status["pinnedDigest"]}, "Ready while old pods remain"
            assert (status["updatedReplicas"], status["readyReplicas"]) == (2, 2)
            break
    else:
        raise AssertionError("the rollout did not finish")
    assert seen_not_ready, "Ready never dropped during the rollout"


@needs_engine
def test_revision_mismatch_is_degraded(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apply(*example(revision="sha256:" + "0" * 64), namespace=namespace)

    def degraded() -> dict[str, Any] | None:
        found = condition(pool_status(cluster, namespace, POOL), "Degraded")
        return found if found.get("reason") == "RevisionMismatch" else None

    found = wait_for("Degraded RevisionMismatch", degraded, ENGINE_START_SECONDS, interval=2)
    assert found["status"] == "True" and "sha256:" + "0" * 64 in found["message"]


def tamper_and_restart_a_pod(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> str:
    """With the operator away (it would restore the ConfigMap at once), tamper with the template
    every pod mounts and restart one pod: it now runs another template. That pod, once ready."""
    operator.stop()
    try:
        tamper_template(cluster, namespace, POOL)
        before = {p["metadata"]["name"] for p in live_pods(cluster, namespace, POOL)}
        victim = sorted(before)[0]
        cluster.kubectl("delete", "pod", victim, "-n", namespace)

        def replacement_ready() -> str | None:
            pods = live_pods(cluster, namespace, POOL)
            new = [p for p in pods if p["metadata"]["name"] not in before and pod_ready(p)]
            return new[0]["metadata"]["name"] if new else None

        return wait_for("the replacement pod", replacement_ready, ENGINE_START_SECONDS)
    finally:
        operator.start()


def drift_reported(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str, replacement: str
) -> None:
    """The operator's first pass restores the ConfigMap and checks every ready replica: the
    replacement's template is reported, as drift in the status, an Event and a metric."""

    def drifted() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, POOL)
        return status if condition(status, "Drifted").get("status") == "True" else None

    status = wait_for("Drifted", drifted, 2 * DRIFT_INTERVAL_SECONDS + 30, interval=0.5)
    event_saying(
        cluster, namespace, "ConfigMapRestored", "smollm2-chat-engine differed at .data.template"
    )
    [entry] = status["drift"]
    assert entry == {
        "pod": replacement,
        "field": "chatTemplateSha256",
        "expected": status["pinned"]["chatTemplateSha256"],
        "actual": hashlib.sha256(TAMPERED_TEMPLATE.encode()).hexdigest(),
    }
    event_saying(cluster, namespace, "DriftDetected", entry["pod"])
    assert (
        f'llmpool_operator_drifted_replicas{{namespace="{namespace}",pool="{POOL}"}} 1.0'
        in operator.metrics()
    )


@needs_engine
def test_drift_is_detected_reported_and_recreated(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    serving_pool(
        cluster, namespace, drift={"policy": "Report", "intervalSeconds": DRIFT_INTERVAL_SECONDS}
    )
    drifted = tamper_and_restart_a_pod(operator, cluster, namespace)
    drift_reported(operator, cluster, namespace, drifted)

    patch_pool(cluster, namespace, POOL, {"drift": {"policy": "Recreate"}})

    def recovered() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, POOL)
        names = {p["metadata"]["name"] for p in live_pods(cluster, namespace, POOL)}
        done = condition(status, "Drifted").get("status") == "False" and drifted not in names
        return status if done and condition(status, "Ready").get("status") == "True" else None

    status = wait_for("the drifted pod to be replaced", recovered, ENGINE_START_SECONDS, interval=1)
    assert status["drift"] == []
    event_saying(cluster, namespace, "RecreatingDriftedPod", drifted)


@needs_engine
def test_drift_that_recreation_cannot_fix_is_degraded(
    operator: OperatorProcess, cluster: ClusterHandle, namespace: str
) -> None:
    drift = {"policy": "Recreate", "intervalSeconds": DRIFT_INTERVAL_SECONDS}
    serving_pool(cluster, namespace, replicas=1, drift=drift)

    # Someone adds an environment variable the operator does not render (so it never removes
    # it): every new pod now loads int8 weights (the engine's --quantization default comes from
    # LLMPOOL_QUANTIZATION, and quantization none is rendered as no flag), whatever the pin says.
    container = {"name": "engine", "env": [{"name": "LLMPOOL_QUANTIZATION", "value": "int8"}]}
    patch = {"spec": {"template": {"spec": {"containers": [container]}}}}
    cluster.kubectl(
        "patch", "deployment", POOL, "-n", namespace, "-p", json.dumps(patch)
    )  # fmt: skip

    def persists() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, POOL)
        return status if condition(status, "Degraded").get("reason") == "DriftPersists" else None

    # The rollout of the edit, then three recreations: five engine starts in all.
    status = wait_for("Degraded DriftPersists", persists, 5 * ENGINE_START_SECONDS, interval=2)
    assert status["driftRecreations"] == 3
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True"
    assert "3 recreation(s)" in degraded["message"]
    assert "quantization is int8, expected none" in degraded["message"]
    recreated = (
        f'llmpool_operator_recreated_pods_total{{namespace="{namespace}",pool="{POOL}"}} 3.0'
    )
    assert recreated in operator.metrics()

    # The count lives in status: a restarted operator checks again but deletes nothing.
    operator.stop()
    operator.start()
    labels = f'{{namespace="{namespace}",pool="{POOL}"}}'

    def checked_after_restart() -> str | None:
        try:
            text = operator.metrics()
        except OSError:
            return None  # not listening yet
        return text if f"llmpool_operator_drifted_replicas{labels} 1.0" in text else None

    text = wait_for("the restarted operator's first drift check", checked_after_restart, 60)
    assert f"llmpool_operator_recreated_pods_total{labels}" not in text
    status = pool_status(cluster, namespace, POOL)
    assert status["driftRecreations"] == 3
    assert condition(status, "Degraded").get("reason") == "DriftPersists"
