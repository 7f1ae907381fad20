"""Pod semantics on the node, in pods of the project's image: probes, restarts, environment,
volumes, in-cluster API access, pod-to-pod traffic and graceful termination."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import IMAGE, ClusterHandle, container_status, phase, pod_ready

pytestmark = pytest.mark.e2e

HTTP_SERVER = ["python3", "-m", "http.server", "8080"]


def pod(
    name: str, command: list[str], container: dict[str, Any] | None = None, **spec: Any
) -> dict[str, Any]:
    main = {"name": "main", "image": IMAGE, "command": command, **(container or {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [main], **spec},
    }


def running(p: dict[str, Any]) -> bool:
    return phase(p) == "Running"


def test_failing_readiness_probe_keeps_pod_not_ready(
    cluster: ClusterHandle, namespace: str
) -> None:
    probe = {"httpGet": {"path": "/", "port": 9999}, "periodSeconds": 1, "failureThreshold": 1}
    container = {"readinessProbe": probe, "workingDir": "/tmp"}
    cluster.apply(pod("unready", HTTP_SERVER, container), namespace=namespace)
    cluster.wait_pod(namespace, "unready", "to run", running)
    time.sleep(5)  # several probe periods
    current = cluster.get("pod", "unready", "-n", namespace)
    assert phase(current) == "Running"
    assert not pod_ready(current)
    assert container_status(current)["ready"] is False


def test_exiting_process_is_restarted(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(pod("crasher", ["sh", "-c", "echo started; exit 3"]), namespace=namespace)
    current = cluster.wait_pod(
        namespace,
        "crasher",
        "to restart twice",
        lambda p: container_status(p).get("restartCount", 0) >= 2,
        60,
    )
    assert container_status(current)["lastState"]["terminated"]["exitCode"] == 3
    assert phase(current) == "Running"


@pytest.mark.parametrize(
    ("policy", "exit_code", "final_phase"),
    [("Never", 1, "Failed"), ("Never", 0, "Succeeded"), ("OnFailure", 0, "Succeeded")],
)
def test_restart_policy_ends_in_phase(
    cluster: ClusterHandle, namespace: str, policy: str, exit_code: int, final_phase: str
) -> None:
    cluster.apply(
        pod("once", ["sh", "-c", f"exit {exit_code}"], restartPolicy=policy), namespace=namespace
    )
    current = cluster.wait_finished(namespace, "once")
    assert phase(current) == final_phase
    assert container_status(current)["restartCount"] == 0
    assert container_status(current)["state"]["terminated"]["exitCode"] == exit_code


def test_on_failure_restarts_until_success(cluster: ClusterHandle, namespace: str) -> None:
    # The emptyDir outlives restarts: the first run fails, the second succeeds.
    script = "if [ -e /scratch/ran ]; then exit 0; fi; touch /scratch/ran; exit 1"
    container = {"volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}
    manifest = pod(
        "retry",
        ["sh", "-c", script],
        container,
        restartPolicy="OnFailure",
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    cluster.apply(manifest, namespace=namespace)
    current = cluster.wait_finished(namespace, "retry")
    assert phase(current) == "Succeeded"
    assert container_status(current)["restartCount"] == 1


def test_environment_and_volumes(cluster: ClusterHandle, namespace: str) -> None:
    cluster.kubectl(
        "create", "configmap", "settings", "-n", namespace,
        "--from-literal=model=tiny", "--from-literal=template.jinja={{ messages }}",
    )  # fmt: skip
    cluster.kubectl(
        "create", "secret", "generic", "creds", "-n", namespace, "--from-literal=token=s3cret"
    )
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "model"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "ADDR", "value": "$(POD_IP):8000"},
    ]
    template = {"name": "settings", "items": [{"key": "template.jinja", "path": "chat.jinja"}]}
    container = {"env": env, "args": ["$(MODEL)-$$(MODEL)"],
                 "volumeMounts": [{"name": "tpl", "mountPath": "/etc/e2e-tpl", "readOnly": True}]}  # fmt: skip
    script = (
        'echo "name=$POD_NAME ns=$POD_NAMESPACE addr=$ADDR model=$MODEL token=$TOKEN arg=$1"; '
        "cat /etc/e2e-tpl/chat.jinja; echo; touch /etc/e2e-tpl/x 2>/dev/null || echo read-only"
    )
    manifest = pod("envtest", ["sh", "-c", script, "sh"], container, restartPolicy="Never",
                   volumes=[{"name": "tpl", "configMap": template}])  # fmt: skip
    cluster.apply(manifest, namespace=namespace)
    current = cluster.wait_finished(namespace, "envtest")
    logs = cluster.kubectl("logs", "envtest", "-n", namespace)
    assert phase(current) == "Succeeded", logs
    ip = current["status"]["podIP"]
    assert (
        f"name=envtest ns={namespace} addr={ip}:8000 model=tiny token=s3cret arg=tiny-$(MODEL)"
        in logs
    )
    assert "{{ messages }}" in logs
    assert "read-only" in logs


def test_in_cluster_config_reaches_the_apiserver(cluster: ClusterHandle, namespace: str) -> None:
    code = (
        "from kubernetes import client, config; config.load_incluster_config(); "
        "print('version', client.VersionApi().get_code().git_version)"
    )
    cluster.apply(
        pod("incluster", ["python3", "-c", code], restartPolicy="Never"), namespace=namespace
    )
    current = cluster.wait_finished(namespace, "incluster")
    logs = cluster.kubectl("logs", "incluster", "-n", namespace)
    assert phase(current) == "Succeeded", logs
    assert "version v1." in logs


def test_pods_reach_each_other(cluster: ClusterHandle, namespace: str) -> None:
    probe = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    cluster.apply(
        pod("server", HTTP_SERVER, {"workingDir": "/tmp", "readinessProbe": probe}),
        namespace=namespace,
    )
    ip = cluster.wait_pod(namespace, "server", "to be ready", pod_ready)["status"]["podIP"]
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://{ip}:8080/').status)"
    cluster.apply(
        pod("client", ["python3", "-c", fetch], restartPolicy="Never"), namespace=namespace
    )
    cluster.wait_finished(namespace, "client")
    assert cluster.kubectl("logs", "client", "-n", namespace).strip() == "200"


def _deletion_seconds(cluster: ClusterHandle, namespace: str, name: str) -> float:
    cluster.wait_pod(namespace, name, "to run", running)
    started = time.monotonic()
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true", "--timeout=60s")
    return time.monotonic() - started


def test_termination_waits_out_the_grace_period(cluster: ClusterHandle, namespace: str) -> None:
    # The process ignores SIGTERM, so only the SIGKILL after the grace period ends it.
    stubborn = ["sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"]
    cluster.apply(pod("stubborn", stubborn, terminationGracePeriodSeconds=3), namespace=namespace)
    assert 3 <= _deletion_seconds(cluster, namespace, "stubborn") < 20


def test_sigterm_ends_a_cooperative_pod_promptly(cluster: ClusterHandle, namespace: str) -> None:
    # PID 1 of a container gets no default signal handlers: a cooperative process sets one.
    polite = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"]
    cluster.apply(pod("polite", polite, terminationGracePeriodSeconds=30), namespace=namespace)
    assert _deletion_seconds(cluster, namespace, "polite") < 10


def test_liveness_failure_restarts_the_container(cluster: ClusterHandle, namespace: str) -> None:
    liveness = {"httpGet": {"path": "/", "port": 9999}, "periodSeconds": 1, "failureThreshold": 2}
    manifest = pod(
        "unhealthy", ["sleep", "1000"], {"livenessProbe": liveness}, terminationGracePeriodSeconds=1
    )
    cluster.apply(manifest, namespace=namespace)
    cluster.wait_pod(
        namespace,
        "unhealthy",
        "to be restarted",
        lambda p: container_status(p).get("restartCount", 0) >= 1,
        60,
    )


def test_logs_follow_ends_with_the_container(cluster: ClusterHandle, namespace: str) -> None:
    script = "for i in 1 2 3; do echo line $i; sleep 0.5; done"
    cluster.apply(pod("talker", ["sh", "-c", script], restartPolicy="Never"), namespace=namespace)
    cluster.wait_pod(
        namespace, "talker", "to start", lambda p: phase(p) in ("Running", "Succeeded")
    )
    followed = cluster.run("kubectl", "logs", "-f", "talker", "-n", namespace, timeout=30)
    assert followed.stdout.split("\n")[:3] == ["line 1", "line 2", "line 3"]
    assert cluster.kubectl("logs", "talker", "-n", namespace, "--tail=1").strip() == "line 3"
