"""Test-side handle on the e2e cluster: real kubectl and helm, and polling helpers."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from llmpool.fleet_key import ENGINE_KEY_FIELD
from llmpool.operator import naming

T = TypeVar("T")

# The project's image, which engine, operator and client pods run: built by
# scripts/build-image.sh and loaded into the node (`e2e/cluster load`) by the session fixture.
IMAGE = os.environ.get("LLMPOOL_IMAGE", "ghcr.io/llmpool/llmpool:0.1.0")


@dataclass(frozen=True)
class ClusterHandle:
    kubeconfig: Path
    env: dict[str, str]
    logs_dir: Path

    def run(
        self, *argv: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:  # noqa: A002
        proc = subprocess.run(
            argv,
            input=input,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:  # noqa: A002
        return self.run("kubectl", *args, input=input, check=check).stdout

    def get(self, *args: str) -> dict[str, Any]:
        """``kubectl get ... -o json``, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, *manifests: dict[str, Any], namespace: str | None = None) -> None:
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=yaml.safe_dump_all(manifests))

    def helm(self, *args: str) -> str:
        return self.run("helm", *args).stdout

    def wait_pod(
        self,
        namespace: str,
        name: str,
        what: str,
        done: Callable[[dict[str, Any]], bool],
        timeout: float = 90,
    ) -> dict[str, Any]:
        """Poll pod ``name`` until ``done(pod)``; return the pod."""

        def probe() -> dict[str, Any] | None:
            found = self.run(
                "kubectl", "get", "pod", name, "-n", namespace, "-o", "json", check=False
            )
            pod = json.loads(found.stdout) if found.returncode == 0 else None
            return pod if pod is not None and done(pod) else None

        return wait_for(f"pod {name} {what}", probe, timeout)

    def wait_finished(self, namespace: str, name: str, timeout: float = 90) -> dict[str, Any]:
        """Wait until the pod has phase Succeeded or Failed; return the pod."""
        return self.wait_pod(
            namespace, name, "to finish", lambda p: phase(p) in ("Succeeded", "Failed"), timeout
        )


def wait_for(
    what: str, probe: Callable[[], T | None], timeout: float = 90, interval: float = 0.5
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def event_saying(cluster: ClusterHandle, namespace: str, reason: str, text: str) -> str:
    """The Events of ``reason`` once one of them holds ``text``: kopf posts Events from a queue
    of its own, so one may trail the status patch or the child it reports by a moment."""

    def events() -> str | None:
        found = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"reason={reason}"
        )
        return found if text in found else None

    return wait_for(f"an Event {reason} saying {text!r}", events, 30)


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def phase(pod: dict[str, Any]) -> str:
    return pod.get("status", {}).get("phase", "")


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    """The status of the pod's first container ({} before the kubelet reported any)."""
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return statuses[0] if statuses else {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


START_ATTEMPTS = 3
# The engines' --gemm-probe-patience on this node: never quiet (its control plane, the tests and
# neighbouring engines share 2 cores), so every start would wait out the default 15 s of it and
# then keep the least disturbed run's choice anyway. The probes' own tests are in tests/.
ENGINE_GEMM_PROBE_PATIENCE = 0


class OperatorProcess:
    """`llmpool operator` as a local process, with its log kept for failures."""

    def __init__(self, cluster: ClusterHandle, log_path: Path, *extra: str) -> None:
        self.cluster = cluster
        self.extra = extra
        self.log_path = log_path
        self.metrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the operator and wait until its liveness endpoint answers, which kopf does once
        the start-up handlers ran (the metrics server among them). A start that exits first is
        retried on fresh ports: a port ``free_port`` gave may be taken before the operator binds
        it (by any outgoing connection's ephemeral port), and an operator that never starts
        leaves a test waiting for pods that never come."""
        for _ in range(START_ATTEMPTS):
            self.metrics_port, liveness_port = free_port(), free_port()
            argv = [sys.executable, "-m", "llmpool.cli", "operator", *self.extra]
            argv += [
                "--engine-gemm-probe-patience",
                str(ENGINE_GEMM_PROBE_PATIENCE),
                "--metrics-port",
                str(self.metrics_port),
                "--liveness-port",
                str(liveness_port),
            ]
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(argv, env=self.cluster.env, stdout=log, stderr=log)
            if self._live(liveness_port):
                return
        raise AssertionError(
            f"the operator exited at start {START_ATTEMPTS} times:\n{self.log()[-3000:]}"
        )

    def _live(self, liveness_port: int, timeout: float = 120) -> bool:
        """Whether the started operator answers on ``liveness_port``; False once it exited."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                url = f"http://127.0.0.1:{liveness_port}/healthz"
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"the operator did not turn live in {timeout:.0f}s:\n{self.log()[-3000:]}"
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        self.process = None

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"
# How long an engine pod may take to become Ready (the first start converts the built-in model).
ENGINE_START_SECONDS = 600


def create_namespace(cluster: ClusterHandle, name: str) -> None:
    """Create namespace ``name`` and wait until pods can be admitted to it: once it has its
    default service account (and the root CA ConfigMap pods mount)."""
    cluster.kubectl("create", "namespace", name)
    for kind, obj in (("serviceaccount", "default"), ("configmap", "kube-root-ca.crt")):
        wait_for(
            f"{kind} {obj} in {name}",
            lambda k=kind, o=obj: cluster.kubectl("get", k, o, "-n", name, check=False),
            30,
        )


def apply_crds(cluster: ClusterHandle, crds: Path = CRDS) -> None:
    """The project's CRDs (from ``crds``), established (already there is fine)."""
    cluster.kubectl("apply", "-f", str(crds))
    for crd in ("llmpools.llmpool.dev", "llmpooldemands.llmpool.dev"):
        cluster.kubectl("wait", "--for=condition=established", f"crd/{crd}")


@contextmanager
def namespace_operator(
    cluster: ClusterHandle, namespace: str, log_path: Path, *extra: str
) -> Iterator[OperatorProcess]:
    """The real operator for one namespace (``extra``: more of its flags), its CRDs established
    first. At the end it is started again if a test stopped it, deletes the namespace's pools
    (it removes their finalizers), and stops."""
    apply_crds(cluster)
    process = OperatorProcess(cluster, log_path, "-n", namespace, "--standalone", *extra)
    process.start()
    yield process
    if process.process is None:
        process.start()
    cluster.run(
        "kubectl", "delete", "llmpools", "--all", "-n", namespace, "--timeout=60s", check=False
    )
    process.stop()


class GatewayProcess:
    """`llmpool gateway` as a local process for one namespace, reaching pods by pod IP."""

    def __init__(
        self,
        cluster: ClusterHandle,
        namespace: str,
        log_path: Path,
        hold_timeout: float = 0,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        """``extra``: more gateway flags; ``env``: the process environment (the cluster's)."""
        self.port = free_port()
        self.log_path = log_path
        argv = [sys.executable, "-m", "llmpool.cli", "gateway", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--namespace", namespace]
        argv += ["--hold-timeout", str(hold_timeout), *extra]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, env=env or cluster.env, stdout=log, stderr=log)
        wait_for("the gateway to be ready", lambda: self.get("/ready")[0] == 200, 120, 0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError as error:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            return 0, str(error)

    def complete(
        self, prompt: str, model: str, max_tokens: int = 2, timeout: float = 120
    ) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def sent_to(self) -> dict[str, float]:
        """Requests the gateway sent, by replica (pod name)."""
        return totals_by(self.get("/metrics")[1], "llmpool_gateway:requests_total", "replica")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)


def samples(metrics: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric in a Prometheus text exposition: (labels, value) each."""
    found = []
    for line in metrics.splitlines():
        if line.startswith(metric + "{"):
            labels, value = line.rsplit(" ", 1)
            found.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return found


def totals_by(metrics: str, metric: str, label: str) -> dict[str, float]:
    """One metric's samples summed by the value of ``label``."""
    totals: dict[str, float] = {}
    for labels, value in samples(metrics, metric):
        totals[labels[label]] = totals.get(labels[label], 0.0) + value
    return totals


# OpenAI clients in a pod of the project's image (which carries the `bench` extra, hence
# `openai`): argv base URL, model, number of chat completions, each from a new client, as from
# independent users. (kube-proxy balances connections, not requests: one client's keep-alive
# connection stays on one replica, which is what the gateway is for.) The key is the pool's,
# from its Secret (OPENAI_API_KEY, as the openai client reads it).
CHAT_CLIENT = (
    "import os, sys, openai\n"
    "base_url, model, count = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
    "for _ in range(count):\n"
    "    client = openai.OpenAI(base_url=base_url, api_key=os.environ['OPENAI_API_KEY'],\n"
    "                           timeout=120, max_retries=5)\n"
    "    reply = client.chat.completions.create(model=model, max_tokens=4,\n"
    "        messages=[{'role': 'user', 'content': 'Say hello.'}])\n"
    "    print(reply.model, reply.choices[0].finish_reason, reply.usage.completion_tokens)\n"
    "    client.close()\n"
)


def run_client_job(cluster: ClusterHandle, namespace: str, name: str, pool: str, *argv: str) -> str:
    """Run CHAT_CLIENT as a Job in ``namespace`` with ``pool``'s engine key; return its output
    once it succeeded."""
    key = {"name": naming.engine_key_secret_name(pool), "key": ENGINE_KEY_FIELD}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "client",
                            "image": IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["python3", "-c", CHAT_CLIENT, *argv],
                            "env": [{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": key}}],
                        }
                    ],
                }
            },
        },
    }
    cluster.apply(job, namespace=namespace)

    def finished() -> dict[str, Any] | None:
        status = cluster.get("job", name, "-n", namespace).get("status", {})
        return status if status.get("succeeded") or status.get("failed") else None

    status = wait_for(f"Job {name}", finished, 300, interval=1)
    logs = cluster.kubectl("logs", f"job/{name}", "-n", namespace)
    assert status.get("succeeded") == 1, logs
    return logs


def example(file: str, replicas: int) -> list[dict[str, Any]]:
    """An example's documents, its pool made small: ``replicas`` replicas, short context, a
    small KV cache and no resource requests."""
    documents = [d for d in yaml.safe_load_all((ROOT / "examples" / file).read_text()) if d]
    spec = next(d for d in documents if d["kind"] == naming.KIND)["spec"]
    spec["replicas"] = replicas
    spec["maxModelLen"] = 512
    spec["engine"] = {
        **spec["engine"], "maxNumSeqs": 8, "maxNumBatchedTokens": 512, "kvCacheMemory": "32Mi",
    }  # fmt: skip
    spec.pop("resources", None)
    return documents


def pool_status(cluster: ClusterHandle, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get("llmpool", name, "-n", namespace).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def wait_pool_ready(cluster: ClusterHandle, namespace: str, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, name)
        return status if condition(status, "Ready").get("status") == "True" else None

    return wait_for(f"LLMPool {name} Ready", ready, ENGINE_START_SECONDS, 1)


def live_pods(cluster: ClusterHandle, namespace: str, pool: str) -> list[dict[str, Any]]:
    pods = cluster.get("pods", "-n", namespace, "-l", naming.selector_string(pool))["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def replace_first_pod(
    cluster: ClusterHandle, namespace: str, pool: str
) -> tuple[set[str], str, str]:
    """Delete the first (by name) of a pool's pods and wait for a ready pod in its place:
    (the pods before, the deleted one, its replacement)."""
    before = {p["metadata"]["name"] for p in live_pods(cluster, namespace, pool)}
    victim = sorted(before)[0]
    cluster.kubectl("delete", "pod", victim, "-n", namespace, "--wait=false")

    def replacement() -> str | None:
        new = [
            p["metadata"]["name"]
            for p in live_pods(cluster, namespace, pool)
            if p["metadata"]["name"] not in before and pod_ready(p)
        ]
        return new[0] if new else None

    return before, victim, wait_for("the replacement pod", replacement, ENGINE_START_SECONDS)


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key)
    }


def engine_key(cluster: ClusterHandle, namespace: str, pool: str) -> str:
    """The key a pool's engines require (the chart's fleet key is on by default): what a
    caller of the pool's ``status.endpoint`` reads from the pool's Secret."""
    secret = cluster.get("secret", naming.engine_key_secret_name(pool), "-n", namespace)
    return base64.b64decode(secret["data"][ENGINE_KEY_FIELD]).decode()


def patch_pool(cluster: ClusterHandle, namespace: str, pool: str, spec: dict[str, Any]) -> None:
    """Merge ``spec`` into the pool's spec, as `kubectl patch --type=merge` does."""
    cluster.kubectl(
        "patch", "llmpool", pool, "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": spec}),
    )  # fmt: skip


# What a tampered chat template reads: the template every engine pod mounts, edited by hand.
TAMPERED_TEMPLATE = "{{ messages }} tampered"


def tamper_template(cluster: ClusterHandle, namespace: str, pool: str) -> None:
    """Edit the chat template in the pool's ConfigMap (the operator, if running, restores it)."""
    patch = {"data": {"template": TAMPERED_TEMPLATE}}
    cluster.kubectl(
        "patch", "configmap", naming.configmap_name(pool), "-n", namespace, "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip


def deployment(
    name: str, labels: dict[str, str], container: dict[str, Any], replicas: int
) -> dict[str, Any]:
    """A Deployment of ``replicas`` pods of one container, selected by ``labels``."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
