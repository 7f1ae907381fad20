"""LoRA adapters on the real node: pinned, loaded without restarts, drift-checked and routed.

Adapters are PEFT folders written on the node under one directory, which the operator mounts
into the engine pods read-only (``file://`` sources, allowed by the operator's flags). The
operator loads them over each replica's API; the gateway routes an adapter's requests only to
replicas whose ``/fingerprint`` shows the pinned files.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import (
    ENGINE_START_SECONDS,
    ClusterHandle,
    GatewayProcess,
    OperatorProcess,
    engine_key,
    event_saying,
    example,
    grew,
    live_pods,
    namespace_operator,
    patch_pool,
    pool_status,
    replace_first_pod,
    run_client_job,
    wait_for,
)
from transformers import AutoConfig

from llmpool.engine import model_source
from llmpool.engine.lora.adapter import random_adapter
from llmpool.engine.models.llama import LlamaShape

pytestmark = pytest.mark.e2e

POOL = "smollm2-chat"
MODEL = "smollm2"
ADAPTER_ROOT = Path("/var/lib/llmpool-e2e/adapters")
DRIFT_INTERVAL_SECONDS = 3
STD = 0.2  # large enough that each adapter visibly changes greedy continuations
MODULES = {"a": ["q_proj", "v_proj"], "b": ["o_proj", "down_proj"], "c": ["gate_proj", "up_proj"]}


def readable(folder: Path) -> None:
    """A folder tree the engine, a non-root user, can read (safetensors writes files 0600)."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def builtin_shape() -> LlamaShape:
    """The shape of the built-in model, which the adapters fit."""
    return LlamaShape.from_hf_config(AutoConfig.from_pretrained(model_source.resolve(None).folder))


@pytest.fixture
def adapters(namespace: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """Three random adapters of the built-in model on the node: their folder and digests."""
    shape = builtin_shape()
    root = ADAPTER_ROOT / namespace
    digests = {
        name: random_adapter(root / name, shape, modules, rank=8, alpha=16, seed=seed, std=STD)
        for seed, (name, modules) in enumerate(MODULES.items())
    }
    for parent in (ADAPTER_ROOT.parent, ADAPTER_ROOT):
        parent.chmod(0o755)
    readable(root)
    yield root, digests
    shutil.rmtree(root)


@pytest.fixture
def keyed(cluster: ClusterHandle, tmp_path: Path) -> ClusterHandle:
    """The cluster's environment with a fleet key, as the chart gives the operator and the
    gateway: engines answer only with their pool's key."""
    key = tmp_path / "fleet-key"
    key.write_text(secrets.token_hex(32))
    return dataclasses.replace(cluster, env={**cluster.env, "LLMPOOL_FLEET_KEY_FILE": str(key)})


@pytest.fixture
def operator(keyed: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    flags = ("--allow-host-path-models", "--allowed-host-path-prefix", str(ADAPTER_ROOT))
    with namespace_operator(keyed, namespace, tmp_path / "operator.log", *flags) as process:
        yield process


@pytest.fixture
def gateway(keyed: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(keyed, namespace, tmp_path / "gateway.log")
    yield process
    process.stop()


def adapter_spec(root: Path, digests: dict[str, str], names: list[str]) -> list[dict[str, str]]:
    return [{"name": n, "source": f"file://{root / n}", "revision": digests[n]} for n in names]


def served_on(status: dict[str, Any], name: str) -> list[str]:
    entry = next((a for a in status.get("adapters") or [] if a["name"] == name), {})
    return sorted(entry.get("replicas") or [])


def pods_by_uid(cluster: ClusterHandle, namespace: str) -> dict[str, tuple[str, int]]:
    return {
        p["metadata"]["uid"]: (
            p["metadata"]["name"],
            p["status"]["containerStatuses"][0]["restartCount"],
        )
        for p in live_pods(cluster, namespace, POOL)
    }


def complete(gateway: GatewayProcess, model: str, prompt: str) -> tuple[int, dict[str, Any]]:
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    return response.status_code, response.json()


def sent_round(gateway: GatewayProcess, model: str, count: int) -> dict[str, float]:
    """``count`` requests for ``model`` (each prompt new), all answered: what each replica got."""
    before = gateway.sent_to()
    for index in range(count):
        status, answer = complete(gateway, model, f"User {index} asks {model} about the sea")
        assert status == 200, answer
        assert answer["model"] == model
    return grew(before, gateway.sent_to())


def serve_adapters_a_and_b(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess, root: Path,
    digests: dict[str, str],
) -> None:  # fmt: skip
    """The pool pins a and b: both load on both replicas and route by name, through the gateway
    and through status.endpoint."""
    documents = example("smollm2-interactive.yaml", replicas=2)
    spec = documents[-1]["spec"]
    spec["drift"] = {"policy": "Report", "intervalSeconds": DRIFT_INTERVAL_SECONDS}
    spec["lora"] = {"maxLoras": 4, "maxLoraRank": 16}
    spec["adapters"] = adapter_spec(root, digests, ["a", "b"])
    cluster.apply(*documents, namespace=namespace)

    def both_served() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, POOL)
        pods = sorted(p["metadata"]["name"] for p in live_pods(cluster, namespace, POOL))
        ready = len(pods) == 2 and all(served_on(status, n) == pods for n in ("a", "b"))
        return status if ready and not status.get("drift") else None

    wait_for("both adapters on both replicas", both_served, ENGINE_START_SECONDS, 1)
    listed = {m["id"]: m for m in json.loads(gateway.get("/v1/models")[1])["data"]}
    assert listed["a"]["parent"] == listed["b"]["parent"] == MODEL

    # Through the gateway, by adapter name: both replicas serve each adapter.
    wait_for("adapter a through the gateway", lambda: complete(gateway, "a", "hi")[0] == 200, 60)
    assert len(sent_round(gateway, "a", 12)) == 2
    base = complete(gateway, MODEL, "The sea is")[1]["choices"][0]["text"]
    tuned = complete(gateway, "b", "The sea is")[1]["choices"][0]["text"]
    assert tuned != base
    # Through status.endpoint, from a pod, with the official client and the pool's key.
    endpoint = pool_status(cluster, namespace, POOL)["endpoint"]
    logs = run_client_job(cluster, namespace, "adapter-client", POOL, endpoint, "b", "2")
    assert logs.split()[0] == "b", logs


def tampered_adapter_drifts(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess, gateway: GatewayProcess,
    root: Path,
) -> tuple[str, str]:  # fmt: skip
    """With the operator away, a's files change and one pod restarts on them; then a goes only
    where its pinned files are, b and the base model to both replicas; last, a's files are
    restored. (The healthy pod, the drifted one.)"""
    operator.stop()
    try:
        original = {f.name: f.read_bytes() for f in (root / "a").iterdir()}
        random_adapter(
            root / "a", builtin_shape(), MODULES["a"], rank=8, alpha=16, seed=99, std=STD
        )
        readable(root / "a")
        before, victim, drifted = replace_first_pod(cluster, namespace, POOL)
    finally:
        operator.start()
    [healthy] = before - {victim}

    def reported() -> list[dict[str, Any]] | None:
        drift = pool_status(cluster, namespace, POOL).get("drift") or []
        return (
            drift if [(e["pod"], e["field"]) for e in drift] == [(drifted, "adapters.a")] else None
        )

    wait_for("the adapter drift reported", reported, 2 * DRIFT_INTERVAL_SECONDS + 60, 1)
    status = pool_status(cluster, namespace, POOL)
    assert served_on(status, "a") == [healthy]
    assert served_on(status, "b") == sorted([healthy, drifted])
    # a only where its pinned files are; b and the base model on both replicas.
    assert sent_round(gateway, "a", 8) == {healthy: 8}
    wait_for("b on both replicas", lambda: len(sent_round(gateway, "b", 12)) == 2, 60)
    assert len(sent_round(gateway, MODEL, 12)) == 2
    # Healed: the files restored, a pod that failed to load a loads it at the next check.
    for name, data in original.items():
        (root / "a" / name).write_bytes(data)
    return healthy, drifted


def drift_healed(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess, pods: list[str]
) -> None:
    """a is back on both ``pods`` and the drift gone, in the status and in the routing."""

    def healed() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, POOL)
        both = served_on(status, "a") == sorted(pods)
        return status if both and not status.get("drift") else None

    wait_for("the drift healed", healed, 2 * DRIFT_INTERVAL_SECONDS + 60, 1)
    wait_for("a on both replicas again", lambda: len(sent_round(gateway, "a", 12)) == 2, 60)


def third_adapter_without_restart(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess, root: Path,
    digests: dict[str, str],
) -> dict[str, tuple[str, int]]:  # fmt: skip
    """A third adapter in the spec is served on every replica without a pod restart: the pods
    (``pods_by_uid``), unchanged."""
    pods = pods_by_uid(cluster, namespace)
    patch_pool(cluster, namespace, POOL, {"adapters": adapter_spec(root, digests, ["a", "b", "c"])})
    names = sorted(name for name, _ in pods.values())
    wait_for(
        "adapter c on both replicas",
        lambda: served_on(pool_status(cluster, namespace, POOL), "c") == names,
        60,
        1,
    )
    wait_for("c through the gateway", lambda: complete(gateway, "c", "hi")[0] == 200, 60)
    assert pods_by_uid(cluster, namespace) == pods
    return pods


def bad_adapters_are_refused(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess, root: Path
) -> None:
    """Bad adapters and bad requests are 4xx; the replica stays healthy."""
    big = root / "rank32"
    random_adapter(big, builtin_shape(), ["q_proj"], rank=32, alpha=32, seed=5)
    readable(big)
    pod = live_pods(cluster, namespace, POOL)[0]
    url = f"http://{pod['status']['podIP']}:8000"
    headers = {"Authorization": f"Bearer {engine_key(cluster, namespace, POOL)}"}
    loads = [
        ({"lora_name": "big", "lora_path": str(big)}, 400, "lora_rank_exceeded"),
        ({"lora_name": "gone", "lora_path": str(root / "missing")}, 400, "invalid_adapter"),
        ({"lora_name": "c", "lora_path": str(root / "a")}, 409, "adapter_exists"),
    ]
    for body, code, reason in loads:
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=30)
        assert (response.status_code, response.json()["error"]["code"]) == (code, reason), body
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    status_code, answer = complete(gateway, "no-such-adapter", "hi")
    assert status_code == 404, answer


def test_pinned_adapters_load_live_drift_and_route(
    cluster: ClusterHandle,
    namespace: str,
    adapters: tuple[Path, dict[str, str]],
    operator: OperatorProcess,
    gateway: GatewayProcess,
) -> None:
    root, digests = adapters
    serve_adapters_a_and_b(cluster, namespace, gateway, root, digests)
    healthy, drifted = tampered_adapter_drifts(cluster, namespace, operator, gateway, root)
    drift_healed(cluster, namespace, gateway, [healthy, drifted])
    kept = third_adapter_without_restart(cluster, namespace, gateway, root, digests)
    bad_adapters_are_refused(cluster, namespace, gateway, root)
    for reason in ("AdapterLoaded", "AdapterLoadFailed"):
        event_saying(cluster, namespace, reason, POOL)
    assert pods_by_uid(cluster, namespace) == kept
