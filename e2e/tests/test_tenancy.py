"""Two tenants on the real control plane: two namespaces, each with a pool of one served name,
and two API key Secrets; the gateway (a local process, tenants from those Secrets) sends each key
to its own pool only, and the engines take only their pool's key.

The real operator serves both namespaces, with the fleet key from a file as the chart mounts it,
so each pool's engines require their own key (from the pool's Secret); the gateway reaches the
pods by pod IP, and so does the direct call to an engine.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness import (
    ENGINE_START_SECONDS,
    ROOT,
    ClusterHandle,
    OperatorProcess,
    apply_crds,
    condition,
    create_namespace,
    free_port,
    live_pods,
    pod_ready,
    pool_status,
    totals_by,
    wait_for,
)

from llmpool.fleet_key import FLEET_KEY_FILE_ENV, FleetKey
from llmpool.gateway.tenants import API_KEY_LABEL
from llmpool.operator import naming

pytestmark = pytest.mark.e2e

POOL = "smollm2-chat"
REQUESTS_PER_MINUTE = 3  # team b's limit


def pool_object() -> dict[str, Any]:
    """The interactive example, as small as it runs: one replica, no chat template to copy."""
    documents = yaml.safe_load_all((ROOT / "examples" / "smollm2-interactive.yaml").read_text())
    pool = next(d for d in documents if d["kind"] == naming.KIND)
    spec = pool["spec"]
    spec.pop("chatTemplate")
    spec.pop("resources", None)
    spec["replicas"] = 1
    spec["maxModelLen"] = 512
    spec["engine"] = {**spec["engine"], "maxNumSeqs": 8, "kvCacheMemory": "32Mi"}
    spec["drift"] = {"policy": "Report", "intervalSeconds": 3600}
    return pool


def key_secret(name: str, key: str, scope: str, **limits: str) -> dict[str, Any]:
    data = {"api-key": key, "scope": scope, **limits}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {API_KEY_LABEL: "true"}},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


@pytest.fixture
def teams(cluster: ClusterHandle) -> Iterator[tuple[str, str]]:
    """Two fresh namespaces, one per tenant, deleted (without waiting) afterwards."""
    names = tuple(f"e2e-team-{uuid.uuid4().hex[:6]}" for _ in range(2))
    for name in names:
        create_namespace(cluster, name)
    yield names[0], names[1]
    for name in names:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def fleet_key(tmp_path: Path) -> Path:
    path = tmp_path / "fleet-key"
    path.write_text(secrets.token_hex(32))
    return path


@pytest.fixture
def operator(
    cluster: ClusterHandle, teams: tuple[str, str], fleet_key: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    with_key = dataclasses.replace(cluster, env={**cluster.env, FLEET_KEY_FILE_ENV: str(fleet_key)})
    namespaces = [arg for team in teams for arg in ("-n", team)]
    process = OperatorProcess(with_key, tmp_path / "operator.log", *namespaces, "--standalone")
    process.start()
    yield process
    for team in teams:  # the pools carry the operator's finalizer: remove them while it runs
        cluster.run(
            "kubectl", "delete", "llmpools", "--all", "-n", team, "--timeout=60s", check=False
        )
    process.stop()


class Gateway:
    """`llmpool gateway` for both teams, tenants from the key Secrets of ``keys_namespace``."""

    def __init__(
        self, cluster: ClusterHandle, teams: tuple[str, str], keys_namespace: str,
        fleet_key: Path, log_path: Path,
    ) -> None:  # fmt: skip
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "llmpool.cli", "gateway", "--host", "127.0.0.1"]
        argv += ["--port", self.url.rsplit(":", 1)[1], "--api-key-namespace", keys_namespace]
        argv += [arg for team in teams for arg in ("--namespace", team)]
        env = {**cluster.env, FLEET_KEY_FILE_ENV: str(fleet_key)}
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        wait_for("the gateway to be ready", self._ready, 120, 0.5)

    def _ready(self) -> bool:
        assert self.process.poll() is None, self.log_path.read_text()[-3000:]
        try:
            return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self, key: str | None, model: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": model, "prompt": "Hello", "max_tokens": 2}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=60)

    def models(self, key: str) -> list[str]:
        answer = httpx.get(
            f"{self.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        return [m["id"] for m in answer.raise_for_status().json()["data"]]

    def sent_to_pools(self) -> dict[str, float]:
        metrics = httpx.get(f"{self.url}/metrics", timeout=10).text
        return totals_by(metrics, "llmpool_gateway:requests_total", "pool")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def each_key_reaches_its_own_pool(gateway: Gateway, teams: tuple[str, str], served: str) -> None:
    """Each key sees and reaches its own pool only, under the one served name; the other's
    model is a 404 as any model that does not exist; no key is a 401."""
    team_a, team_b = teams
    assert gateway.models("key-a") == [served]
    assert gateway.models("key-b") == [served]
    for key, team in (("key-a", team_a), ("key-b", team_b)):
        before = gateway.sent_to_pools().get(f"{team}/{POOL}", 0)
        answer = wait_for(
            f"{team} answering", lambda k=key: _ok(gateway.complete(k, served)), 60, 0.5
        )
        assert answer["choices"][0]["text"] is not None
        assert gateway.sent_to_pools()[f"{team}/{POOL}"] >= before + 1

    for model in (f"{team_b}/{served}", "no-such-model"):
        refused = gateway.complete("key-a", model)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
    for key in (None, "wrong"):
        refused = gateway.complete(key, served)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def a_limit_applies_without_a_restart(
    cluster: ClusterHandle, gateway: Gateway, keys_namespace: str, team_b: str, served: str
) -> None:
    """Team b's Secret now sets a limit of requests per minute: it applies without a restart,
    and past it comes a 429 with Retry-After while team a is served."""
    limits = {"requests-per-minute": str(REQUESTS_PER_MINUTE)}
    cluster.apply(key_secret("team-b", "key-b", team_b, **limits), namespace=keys_namespace)
    limited = wait_for(
        "team b limited",
        lambda: (r := gateway.complete("key-b", served)).status_code == 429 and r,
        60,
        0.2,
    )
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    assert gateway.complete("key-a", served).status_code == 200


def engines_take_only_their_pool_key(
    cluster: ClusterHandle, teams: tuple[str, str], fleet_key: Path, served: str
) -> None:
    """An engine pod called directly: its pool's key opens it, no key does not."""
    team_a, team_b = teams
    pod_ip = _pod_ip(cluster, team_a)
    engine = f"http://{pod_ip}:{naming.ENGINE_PORT}/v1/completions"
    body = {"model": served, "prompt": "Hello", "max_tokens": 1}
    pool_key = FleetKey(fleet_key).engine_key(team_a, POOL)
    keyed = httpx.post(
        engine, json=body, headers={"Authorization": f"Bearer {pool_key}"}, timeout=60
    )
    assert keyed.status_code == 200, keyed.text
    other_pool_key = FleetKey(fleet_key).engine_key(team_b, POOL)
    for headers in (
        {},
        {"Authorization": "Bearer key-a"},
        {"Authorization": f"Bearer {other_pool_key}"},
    ):
        direct = httpx.post(engine, json=body, headers=headers, timeout=60)
        assert direct.status_code == 401, direct.text


def test_each_tenant_reaches_only_its_own_pool_and_engines_only_the_fleet(
    cluster: ClusterHandle,
    namespace: str,
    teams: tuple[str, str],
    operator: OperatorProcess,
    fleet_key: Path,
    tmp_path: Path,
) -> None:
    team_a, team_b = teams
    pool = pool_object()
    served = pool["spec"]["model"]["servedName"]
    for team in teams:
        cluster.apply(pool, namespace=team)
    cluster.apply(
        key_secret("team-a", "key-a", team_a),
        key_secret("team-b", "key-b", team_b),
        namespace=namespace,
    )
    gateway = Gateway(cluster, teams, namespace, fleet_key, tmp_path / "gateway.log")
    try:
        for team in teams:
            wait_for(
                f"{team}/{POOL} Ready", lambda t=team: _ready(cluster, t), ENGINE_START_SECONDS, 1
            )
        each_key_reaches_its_own_pool(gateway, teams, served)
        a_limit_applies_without_a_restart(cluster, gateway, namespace, team_b, served)
        engines_take_only_their_pool_key(cluster, teams, fleet_key, served)
    finally:
        gateway.stop()


def _ready(cluster: ClusterHandle, namespace: str) -> bool:
    return condition(pool_status(cluster, namespace, POOL), "Ready").get("status") == "True"


def _ok(response: httpx.Response) -> dict[str, Any] | None:
    return response.json() if response.status_code == 200 else None


def _pod_ip(cluster: ClusterHandle, namespace: str) -> str:
    (pod,) = [p for p in live_pods(cluster, namespace, POOL) if pod_ready(p)]
    return pod["status"]["podIP"]
