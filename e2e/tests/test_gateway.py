"""`llmpool gateway` on the real control plane: its table from real LLMPools and EndpointSlices.

The first test renders the pool's Service and Deployment with the operator's own functions and
writes the pool's status (Ready, pinnedDigest, drift) by hand, so the routing is checked against
a known table. The later tests run the real operator for the examples' pools (status as it
reports it: Ready, pins, drift) or kill a replica for real. The gateway runs as a local process
with the admin kubeconfig and reaches the pods by pod IP.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness import (
    ENGINE_GEMM_PROBE_PATIENCE,
    ENGINE_START_SECONDS,
    IMAGE,
    ROOT,
    ClusterHandle,
    GatewayProcess,
    OperatorProcess,
    apply_crds,
    condition,
    example,
    grew,
    live_pods,
    namespace_operator,
    patch_pool,
    pod_ready,
    pool_status,
    replace_first_pod,
    samples,
    tamper_template,
    totals_by,
    wait_for,
    wait_pool_ready,
)

from llmpool import pinning
from llmpool.gateway import routing
from llmpool.gateway.pools import Replica
from llmpool.operator import naming, render
from llmpool.operator.spec import PoolSpec

pytestmark = pytest.mark.e2e

POOL = "smollm2-chat"
MODEL = "smollm2"
# IMAGE, the engine image every operator of the suite gives pools (LLMPOOL_ENGINE_IMAGE): an
# `llmpool operator -A` that another test runs on the shared cluster renders the same
# Deployment and rolls no pod.


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
    apply_crds(cluster)
    obj = pool_object()
    spec = PoolSpec.from_dict(obj["spec"])
    digest = pinning.pinned_digest(pinning.pinned_from_spec(obj["spec"], None))
    cluster.apply(
        obj,
        render.render_service(POOL),
        render.render_deployment(
            POOL, spec, digest, IMAGE, gemm_probe_patience_s=ENGINE_GEMM_PROBE_PATIENCE
        ),
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


def mark_ready(cluster: ClusterHandle, namespace: str, digest: str) -> None:
    """The status the operator would write for the two ready replicas of ``engines``.

    The pods' /fingerprint digests must equal the pin's, or they would get no traffic."""
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "2/2",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    set_status(cluster, namespace, {"conditions": [ready], "pinnedDigest": digest})


@pytest.fixture
def gateway(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(cluster, namespace, tmp_path / "gateway.log")
    yield process
    process.stop()


@pytest.fixture
def marked_ready(
    cluster: ClusterHandle, namespace: str, engines: tuple[list[str], str], gateway: GatewayProcess
) -> list[str]:
    """The pods of ``engines``, their pool marked Ready once the gateway runs (``mark_ready``)."""
    pods, digest = engines
    mark_ready(cluster, namespace, digest)
    return pods


# Prompts of as many tenants, so that the prefix keys spread them over the replicas.
PROMPTS = [f"Tenant {tenant} asks about the weather" for tenant in range(12)]


def test_the_gateway_routes_by_endpointslices_and_pool_status(
    cluster: ClusterHandle, namespace: str, marked_ready: list[str], gateway: GatewayProcess
) -> None:
    pods = marked_ready
    listed = wait_for(
        "the model listed",
        lambda: json.loads(gateway.get("/v1/models")[1])["data"],
        30,
    )
    assert [m["id"] for m in listed] == [MODEL]

    for prompt in PROMPTS:
        status, body = gateway.complete(prompt, MODEL)
        assert status == 200, body
    spread = gateway.sent_to()
    assert set(spread) == set(pods), spread  # the replicas are the slices' pods, by name

    # The operator reports the first pod drifted: it gets nothing while the other answers.
    drifted, healthy = pods
    entry = {"pod": drifted, "field": "chatTemplateSha256", "expected": "a", "actual": "b"}
    set_status(cluster, namespace, {"drift": [entry]})
    wait_for("the drift seen", lambda: _drift_applied(gateway, drifted), 30, 0.5)
    before = gateway.sent_to()
    for prompt in PROMPTS:
        assert gateway.complete(prompt, MODEL)[0] == 200
    after = gateway.sent_to()
    assert after.get(drifted, 0) == before.get(drifted, 0)
    assert after[healthy] - before[healthy] == len(PROMPTS)

    # Healed: it takes its share again.
    set_status(cluster, namespace, {"drift": []})
    wait_for("the drifted pod back", lambda: _drift_applied(gateway, None), 30, 0.5)

    status, body = gateway.complete("Hello", "no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def _drift_applied(gateway: GatewayProcess, drifted: str | None) -> bool:
    """Whether one round of PROMPTS matches the drift state: none to ``drifted``, or some to all."""
    before = gateway.sent_to()
    for prompt in PROMPTS:
        gateway.complete(prompt, MODEL)
    after = gateway.sent_to()
    got = {pod: after[pod] - before.get(pod, 0) for pod in after}
    if drifted is not None:
        return got.get(drifted, 0) == 0
    return all(count > 0 for count in got.values()) and len(got) == 2


# --------------------------------------------------------------------------- with the operator

BATCH_POOL = "smollm2-batch"
DRIFT_INTERVAL_SECONDS = 3


def gateway_samples(gateway: GatewayProcess, metric: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one gateway metric: (labels, value) each."""
    return samples(gateway.get("/metrics")[1], metric)


def sent_by(gateway: GatewayProcess, label: str) -> dict[str, float]:
    """Requests the gateway sent to a replica, summed by ``label`` (pool, replica, decision)."""
    return totals_by(gateway.get("/metrics")[1], "llmpool_gateway:requests_total", label)


def post(
    gateway: GatewayProcess, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=60)
    return response.status_code, response.json()


@pytest.fixture
def operator(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The real operator for this test's namespace only."""
    with namespace_operator(cluster, namespace, tmp_path / "operator.log") as process:
        yield process


def test_one_base_url_serves_both_example_pools_by_priority(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess, gateway: GatewayProcess
) -> None:
    interactive = example("smollm2-interactive.yaml", replicas=1)
    batch = example("smollm2-batch.yaml", replicas=1)
    # Both examples serve one name; the gateway decides between them by priority.
    served = interactive[-1]["spec"]["model"]["servedName"]
    assert batch[-1]["spec"]["model"]["servedName"] == served
    cluster.apply(*interactive, *batch, namespace=namespace)
    for name in (POOL, BATCH_POOL):
        wait_pool_ready(cluster, namespace, name)

    listed = wait_for(
        "the model listed", lambda: json.loads(gateway.get("/v1/models")[1])["data"], 30
    )
    assert [m["id"] for m in listed] == [served]

    body = {"model": served, "prompt": "Hello", "max_tokens": 2}
    cases: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({}, {}, POOL),
        ({"priority": "batch"}, {}, BATCH_POOL),
        ({}, {"X-LLMPool-Priority": "batch"}, BATCH_POOL),
        ({"priority": "interactive"}, {"X-LLMPool-Priority": "batch"}, POOL),  # the body wins
        ({"priority": 1}, {}, BATCH_POOL),  # vLLM's integer priority: 1 is batch's
    ]
    # The gateway's watch may see a pool's endpoints a moment after its Ready status.
    wait_for(
        "both pools answering",
        lambda: all(post(gateway, {**body, **extra})[0] == 200 for extra, _, _ in cases[:2]),
        30,
    )
    for extra, headers, pool in cases:
        before = sent_by(gateway, "pool")
        status, answer = post(gateway, {**body, **extra}, headers)
        assert status == 200, answer
        assert grew(before, sent_by(gateway, "pool")) == {f"{namespace}/{pool}": 1}, extra


def test_a_replica_made_to_drift_gets_nothing_until_healed(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess, gateway: GatewayProcess
) -> None:
    documents = example("smollm2-interactive.yaml", replicas=2)
    pool = documents[-1]
    pool["spec"]["drift"] = {"policy": "Report", "intervalSeconds": DRIFT_INTERVAL_SECONDS}
    cluster.apply(*documents, namespace=namespace)
    wait_pool_ready(cluster, namespace, POOL)
    wait_for("traffic on both replicas", lambda: len(_round(gateway)) == 2, 30, 0.5)

    # As in test_operator.py: with the operator away (it would restore the ConfigMap at once),
    # edit the template every pod mounts and restart one pod, which now runs another template.
    operator.stop()
    try:
        tamper_template(cluster, namespace, POOL)
        before, victim, drifted = replace_first_pod(cluster, namespace, POOL)
    finally:
        operator.start()
    [healthy] = before - {victim}

    def reported() -> dict[str, Any] | None:
        status = pool_status(cluster, namespace, POOL)
        return status if [e["pod"] for e in status.get("drift") or []] == [drifted] else None

    status = wait_for("the drift reported", reported, 2 * DRIFT_INTERVAL_SECONDS + 30)
    assert status["drift"][0]["field"] == "chatTemplateSha256"

    # From the report on: the drifted pod gets nothing while the pool answers every request.
    before_counts = gateway.sent_to()
    for prompt in PROMPTS:
        status_code, answer = gateway.complete(prompt, MODEL)
        assert status_code == 200, answer
    got = grew(before_counts, gateway.sent_to())
    assert got == {healthy: len(PROMPTS)}, got
    assert [e["pod"] for e in pool_status(cluster, namespace, POOL)["drift"]] == [drifted]

    # Healed: the operator recreates the pod (from the restored template); both take traffic.
    patch_pool(cluster, namespace, POOL, {"drift": {"policy": "Recreate"}})

    def healed() -> list[str] | None:
        status = pool_status(cluster, namespace, POOL)
        pods = sorted(p["metadata"]["name"] for p in live_pods(cluster, namespace, POOL))
        done = not status.get("drift") and drifted not in pods and len(pods) == 2
        return pods if done and condition(status, "Ready").get("status") == "True" else None

    pods = wait_for("the drifted pod recreated", healed, ENGINE_START_SECONDS, 1)
    wait_for("traffic on both replicas again", lambda: sorted(_round(gateway)) == pods, 30, 0.5)
    assert gateway.sent_to().get(drifted, 0) == 0  # never, over its whole life


def _round(gateway: GatewayProcess) -> dict[str, float]:
    """One request per prompt, each answered; what each replica got."""
    before = gateway.sent_to()
    for prompt in PROMPTS:
        status, answer = gateway.complete(prompt, MODEL)
        assert status == 200, answer
    return grew(before, gateway.sent_to())


# --------------------------------------------------------------------------- a replica killed

STREAMS = 4
REQUESTS = 4
CLIENT_TIMEOUT_SECONDS = 60  # a stream that hangs fails the test instead of stalling it


def _stream(gateway: GatewayProcess, body: dict[str, Any], started: threading.Event) -> list[str]:
    """The data of each event of a streamed completion, until the stream ends."""
    events = []
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json={**body, "stream": True},
        timeout=CLIENT_TIMEOUT_SECONDS,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()
    return events


def in_flight(gateway: GatewayProcess) -> dict[str, float]:
    return {
        labels["replica"]: value
        for labels, value in gateway_samples(gateway, "llmpool_gateway:in_flight_requests")
    }


def ranked_first(pod: str, pods: list[str], stem: str, count: int) -> list[str]:
    """``count`` prompts whose prefix key ranks ``pod`` first among ``pods`` (computed)."""
    candidates = [routing.Candidate(Replica(name, name), 0.0, None) for name in pods]

    def first(text: str) -> str:
        key = routing.prefix_key(routing.prompt_text({"prompt": text}))
        return routing.rank(key, candidates)[0].replica.name

    texts = (f"{stem} {index}: once upon a time" for index in range(1000))
    found = list(itertools.islice((text for text in texts if first(text) == pod), count))
    assert len(found) == count, f"no {count} prompts rank {pod} first"
    return found


def well_formed_error(answer: dict[str, Any]) -> bool:
    error = answer.get("error")
    return isinstance(error, dict) and {"message", "type", "code"} <= set(error)


def kill_mid_load(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess, pods: list[str]
) -> tuple[list[str], list[tuple[int, dict[str, Any]]], list[list[str]]]:
    """Kill the first of ``pods`` (the victim) under load: two streams on each replica, then
    requests that the victim takes until it reaches its load bound, then requests that start
    after the kill. The streams' prompts, every answer and each stream's events."""
    # Prompts whose prefix key ranks a given pod first, as the gateway ranks them.
    victim, survivor = pods
    long = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    stories = ranked_first(victim, pods, "Story", 2) + ranked_first(survivor, pods, "Story", 2)
    questions = ranked_first(victim, pods, "Question", REQUESTS)
    with ThreadPoolExecutor(STREAMS + 2 * REQUESTS) as executor:
        started = [threading.Event() for _ in stories]
        streams = [
            executor.submit(_stream, gateway, {**long, "prompt": story}, event)
            for story, event in zip(stories, started, strict=True)
        ]
        for event in started:
            assert event.wait(CLIENT_TIMEOUT_SECONDS), "a stream did not start"
        assert in_flight(gateway) == {victim: 2, survivor: 2}
        requests = [
            executor.submit(post, gateway, {**long, "prompt": question}) for question in questions
        ]
        wait_for(
            "requests in flight on the victim", lambda: in_flight(gateway)[victim] > 2, 10, 0.1
        )
        cluster.kubectl(
            "delete", "pod", victim, "-n", namespace, "--grace-period=0", "--force", "--wait=false"
        )
        killed_at = time.monotonic()
        # Requests that start after the kill, before or after the gateway hears of it.
        later: list[Future[tuple[int, dict[str, Any]]]] = [
            executor.submit(post, gateway, {"model": MODEL, "prompt": f"Late {i}", "max_tokens": 4})
            for i in range(REQUESTS)
        ]
        answers = [f.result(timeout=2 * CLIENT_TIMEOUT_SECONDS) for f in requests + later]
        events = [f.result(timeout=2 * CLIENT_TIMEOUT_SECONDS) for f in streams]
    print(f"all answered {time.monotonic() - killed_at:.1f}s after the kill")
    return stories, answers, events


def broken_streams(stories: list[str], events: list[list[str]]) -> list[str]:
    """The stories whose stream ended with an error event; every stream ends with [DONE], and
    one not broken with its whole length."""
    broken = []
    for story, stream in zip(stories, events, strict=True):
        assert stream[-1] == "[DONE]", stream[-3:]
        chunks = [json.loads(data) for data in stream[:-1]]
        if "error" in chunks[-1]:
            broken.append(story)
            assert chunks[-1]["error"]["code"] == "upstream_stream_broken", chunks[-1]
        else:
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    return broken


def test_killing_a_replica_mid_load_retries_requests_and_ends_streams(
    cluster: ClusterHandle, namespace: str, marked_ready: list[str], gateway: GatewayProcess
) -> None:
    pods = marked_ready
    wait_for("traffic on both replicas", lambda: len(_round(gateway)) == 2, 30)
    # No replacement for the killed pod: its engine start would only slow the rest down.
    for kind in ("deployment", "replicaset"):
        cluster.kubectl(
            "delete", kind, "-n", namespace, "-l", naming.selector_string(POOL), "--cascade=orphan"
        )
    victim = pods[0]
    stories, answers, events = kill_mid_load(cluster, namespace, gateway, pods)

    for status, answer in answers:
        assert status == 200 or well_formed_error(answer), (status, answer)
    # Not even an error: the requests the victim held were retried on the survivor.
    assert [status for status, _ in answers] == [200] * len(answers), answers
    broken = broken_streams(stories, events)
    assert broken == stories[:2], events  # the streams the victim relayed, and only those

    errors = {
        labels["kind"]: value
        for labels, value in gateway_samples(gateway, "llmpool_gateway:upstream_errors_total")
        if labels["replica"] == victim
    }
    assert errors.get("stream") == len(broken), errors
    retried = sent_by(gateway, "decision").get("retry", 0)
    print(f"killed {victim}: {len(broken)} streams broke, {retried:.0f} requests retried, {errors}")
    assert retried >= 1  # at least the requests the victim held when it died
