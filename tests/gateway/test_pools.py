"""The routing table from LLMPool objects and EndpointSlices as the API server returns them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml

from llmpool.gateway.load import LoadTracker, fingerprint_adapters
from llmpool.gateway.pools import PoolTable, Replica, pool_from_object
from llmpool.load import parse_engine_gauges
from llmpool.operator import naming

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DIGEST = "sha256:" + "c" * 64


def example_pool(file: str, namespace: str = "team-a", **status: Any) -> dict[str, Any]:
    documents = yaml.safe_load_all((EXAMPLES / file).read_text())
    pool = next(d for d in documents if d["kind"] == naming.KIND)
    pool["metadata"]["namespace"] = namespace
    pool["status"] = status
    return pool


READY = {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}]}


def test_a_pool_from_the_interactive_example() -> None:
    obj = example_pool(
        "smollm2-interactive.yaml",
        pinnedDigest=DIGEST,
        drift=[{"pod": "smollm2-chat-x", "field": "chatTemplateSha256"}],
        outgoing=[{"pod": "smollm2-chat-old", "pinnedDigest": "sha256:old"}],
        **READY,
    )
    pool = pool_from_object(obj)
    assert pool.outgoing == {"smollm2-chat-old": "sha256:old"}
    assert (pool.namespace, pool.name, pool.served_name) == ("team-a", "smollm2-chat", "smollm2")
    assert (pool.priority_class, pool.ready, pool.pinned_digest) == ("interactive", True, DIGEST)
    assert pool.drifted == {"smollm2-chat-x"}


def test_a_new_pool_without_status_is_not_ready_and_has_no_pin_yet() -> None:
    pool = pool_from_object(example_pool("smollm2-batch.yaml"))
    assert (pool.priority_class, pool.ready, pool.pinned_digest) == ("batch", False, None)
    assert pool.drifted == frozenset()
    assert pool.outgoing == {}


def test_replicas_are_the_ready_endpoints_of_the_pools_service(make_slice) -> None:
    table = PoolTable()
    table.set_pool(pool_from_object(example_pool("smollm2-interactive.yaml", **READY)))
    service = naming.service_name("smollm2-chat")
    table.set_slice(
        make_slice(
            service,
            "s1",
            [
                ("pod-a", "10.1.0.5", True),
                ("pod-b", "10.1.0.6", False),
                ("pod-c", "fd00::7", None),
                # Stopping: still serving what it holds, but no new request goes there.
                ("pod-d", "10.1.0.9", {"ready": False, "serving": True, "terminating": True}),
                ("pod-e", "10.1.0.10", {"ready": True, "serving": True, "terminating": True}),
                ("pod-f", "10.1.0.11", {"serving": False}),
            ],
        )
    )
    table.set_slice(make_slice("other-service", "s2", [("pod-z", "10.9.9.9", True)]))
    table.set_slice(make_slice(service, "s3", [("pod-q", "10.1.0.8", True)], namespace="team-b"))
    (pool,) = table.pools()
    assert table.replicas(pool) == [
        Replica("pod-a", "http://10.1.0.5:8000"),
        Replica("pod-c", "http://[fd00::7]:8000"),
    ]
    table.delete_slice(("team-a", "s1"))
    assert table.replicas(pool) == []


def test_relists_replace_a_namespace_s_pools() -> None:
    table = PoolTable()
    interactive = pool_from_object(example_pool("smollm2-interactive.yaml", **READY))
    batch = pool_from_object(example_pool("smollm2-batch.yaml"))
    other = pool_from_object(example_pool("smollm2-interactive.yaml", "team-b", **READY))
    table.reset_pools(None, [interactive, batch, other])
    table.reset_pools("team-a", [batch])
    assert [p.key for p in table.pools()] == [("team-a", "smollm2-batch"), other.key]
    table.delete_pool(other.key)
    assert table.pools() == [batch]


ENGINE_METRICS = """\
# HELP llmpool:num_requests_running Requests in the running batch.
# TYPE llmpool:num_requests_running gauge
llmpool:num_requests_running{model_name="smollm2"} 3.0
# HELP llmpool:num_requests_waiting Requests waiting to be scheduled.
# TYPE llmpool:num_requests_waiting gauge
llmpool:num_requests_waiting{model_name="smollm2"} 2.0
# HELP llmpool:kv_cache_usage_perc Fraction of KV-cache blocks in use (1.0 is full).
# TYPE llmpool:kv_cache_usage_perc gauge
llmpool:kv_cache_usage_perc{model_name="smollm2"} 0.5
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="smollm2"} 3.0
"""


def test_load_is_the_larger_of_scrape_and_local_in_flight() -> None:
    gauges = parse_engine_gauges(ENGINE_METRICS)
    assert gauges == {"running": 3.0, "waiting": 2.0, "kv_cache_usage": 0.5}
    tracker = LoadTracker()
    replica = Replica("pod-a", "http://10.1.0.5:8000")
    tracker.record_scrape(replica, gauges)
    assert tracker.get(replica).load == 5.0
    for _ in range(7):  # a burst since the last scrape
        tracker.begin(replica)
    assert tracker.get(replica).load == 7.0
    for _ in range(7):
        tracker.end(replica)
    assert tracker.get(replica).in_flight == 0


def test_held_requests_are_counted_per_pool_and_replicas_forgotten_once_idle() -> None:
    pool = pool_from_object(example_pool("smollm2-interactive.yaml", **READY))
    a, b = Replica("a", "http://10.0.0.1:8000"), Replica("b", "http://10.0.0.2:8000")
    tracker = LoadTracker()
    tracker.record_scrape(a, {"running": 2.0, "waiting": 1.0})
    tracker.begin(b)
    with tracker.held(pool), tracker.held(pool):
        assert tracker.held_count(pool) == 2
    assert tracker.held_count(pool) == 0
    tracker.forget_except([a])
    assert tracker.get(b).in_flight == 1  # still running: kept until it ends
    tracker.end(b)
    tracker.forget_except([a])
    assert tracker.replicas().keys() == {a.url}


def test_adapters_and_their_drift_from_the_pool_object() -> None:
    """An ``adapters.<name>`` drift entry takes that adapter off its pod, not the pod itself."""
    obj = example_pool(
        "smollm2-interactive.yaml",
        pinnedDigest=DIGEST,
        drift=[
            {"pod": "smollm2-chat-x", "field": "chatTemplateSha256"},
            {"pod": "smollm2-chat-y", "field": "adapters.sql", "expected": "sha256:5"},
        ],
        **READY,
    )
    obj["spec"]["adapters"] = [
        {"name": "sql", "source": "file:///adapters/sql", "revision": "sha256:5"},
        {"name": "poet", "source": "pvc://adapters/poet", "revision": "sha256:6"},
    ]
    pool = pool_from_object(obj)
    assert pool.adapters == {"sql": "sha256:5", "poet": "sha256:6"}
    assert pool.drifted == {"smollm2-chat-x"}
    assert pool.adapter_drift == {("smollm2-chat-y", "sql")}
    plain = pool_from_object(example_pool("smollm2-interactive.yaml", **READY))
    assert (plain.adapters, plain.adapter_drift) == ({}, frozenset())


def test_fingerprint_adapters() -> None:
    fingerprint = {
        "digest": DIGEST,
        "lora": {"maxLoras": 4, "maxLoraRank": 16},
        "adapters": [
            {"name": "sql", "digest": "sha256:5", "slot": 0, "rank": 8},
            {"name": "broken"},  # no digest: not counted as loaded
        ],
        "adapterFailures": [{"name": "poet", "digest": "sha256:7", "code": "revision_mismatch"}],
    }
    assert fingerprint_adapters(fingerprint) == {"sql": "sha256:5"}
    assert fingerprint_adapters({"digest": DIGEST, "lora": None}) == {}  # LoRA off


async def test_a_fingerprint_change_wakes_whoever_waits_for_one() -> None:
    tracker = LoadTracker()
    replica = Replica("pod-a", "http://10.1.0.5:8000")
    assert tracker.get(replica).adapters is None  # not scraped: nothing known to be loaded
    waiting = asyncio.ensure_future(tracker.wait_for_fingerprints())
    tracker.record_fingerprint(replica, DIGEST, {})
    await asyncio.wait_for(waiting, 1)
    waiting = asyncio.ensure_future(tracker.wait_for_fingerprints())
    tracker.record_fingerprint(replica, DIGEST, {})  # the same again: no change
    await asyncio.sleep(0)
    assert not waiting.done()
    tracker.record_fingerprint(replica, DIGEST, {"sql": "sha256:5"})
    await asyncio.wait_for(waiting, 1)
    assert tracker.get(replica).adapters == {"sql": "sha256:5"}
