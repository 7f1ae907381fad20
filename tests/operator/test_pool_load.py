"""A pool's load for the autoscaler: engine gauges of its ready pods plus the gateway's holds."""

from __future__ import annotations

import httpx

from llmpool.gateway.demand import demand_recorder
from llmpool.load import (
    DEMAND_CLOCK_SKEW_SECONDS,
    DEMAND_PRUNE_SECONDS,
    DEMAND_TTL_SECONDS,
    Demand,
    demand_records,
    stale_replicas,
)
from llmpool.operator import kube
from llmpool.operator.pool_load import deletion_costs, pool_demand, replica_loads
from llmpool.operator.views import pod_view

ENGINE_METRICS = """\
# TYPE llmpool:num_requests_running gauge
llmpool:num_requests_running{model_name="smollm2"} 3.0
# TYPE llmpool:num_requests_waiting gauge
llmpool:num_requests_waiting{model_name="smollm2"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="smollm2"} 3.0
"""


async def test_ready_pods_are_scraped_and_failures_left_out(make_pod) -> None:
    pods = [
        pod_view(make_pod("a", ip="10.0.0.1")),
        pod_view(make_pod("b", ip="10.0.0.2")),
        pod_view(make_pod("c", ip="10.0.0.3", ready=False)),
    ]
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.host, request.url.path))
        if request.url.host == "10.0.0.2":
            return httpx.Response(503)
        return httpx.Response(200, text=ENGINE_METRICS)

    loads = await replica_loads(pods, transport=httpx.MockTransport(answer))
    assert sorted(asked) == [("10.0.0.1", "/metrics"), ("10.0.0.2", "/metrics")]
    # The vllm: interop copy of a gauge is not counted twice.
    assert loads == {"a": 5.0}


def test_demand_adds_every_gateway_replicas_fresh_holds_only() -> None:
    now = 1_800_000_000.0
    gateways = {
        "gateway-a": Demand(held=4, at=now - 1),
        "gateway-b": Demand(held=3, at=now - 2),
        "gone": Demand(held=9, at=now - DEMAND_TTL_SECONDS - 1),
        # From the future (a skewed or lying clock) it would never expire: not counted.
        "future": Demand(held=50, at=now + DEMAND_CLOCK_SKEW_SECONDS + 1),
        "slightly-ahead": Demand(held=1, at=now + DEMAND_CLOCK_SKEW_SECONDS),
    }
    assert pool_demand({"a": 5.0, "b": 1.0}, gateways, now) == 6.0 + 4 + 3 + 1
    assert pool_demand({}, {}, now) == 0.0


def test_demand_records_round_trip_and_junk_is_ignored() -> None:
    demand = Demand(held=3, at=1_800_000_000.0)
    status = {"gateways": {"gateway-a": demand.to_record()}}
    assert demand_records(status) == {"gateway-a": demand}
    assert demand.held_at(demand.at + DEMAND_TTL_SECONDS) == 3
    assert demand.held_at(demand.at + DEMAND_TTL_SECONDS + 1) == 0
    junk = [{}, {"held": "x", "at": "2027-01-15T08:00:00Z"}, {"held": 1}, [], "x", None]
    assert demand_records({"gateways": {f"g{i}": j for i, j in enumerate(junk)}}) == {}
    assert demand_records({"gateways": []}) == {}
    assert demand_records(None) == {}
    assert Demand.from_record({"held": -4, "at": "2027-01-15T08:00:00Z"}).held == 0


def test_records_of_gateways_long_gone_are_pruned() -> None:
    now = 1_800_000_000.0
    gateways = {
        "alive": Demand(held=0, at=now - 60),
        "gone": Demand(held=2, at=now - DEMAND_PRUNE_SECONDS - 1),
    }
    assert stale_replicas(gateways, now) == ["gone"]


def test_deletion_costs_follow_the_load_and_change_only_when_it_does(make_pod) -> None:
    def pod(name: str, cost: str | None = None, **kwargs) -> object:
        body = make_pod(name, **kwargs)
        if cost is not None:
            body["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] = cost
        return pod_view(body)

    pods = [pod("busy"), pod("idle", cost="4"), pod("same", cost="2"), pod("unknown", cost="7")]
    pods.append(pod("leaving", deleting=True))
    loads = {"busy": 5.4, "idle": 0.0, "same": 2.0, "leaving": 1.0}
    assert deletion_costs(pods, loads) == {"busy": "5", "idle": "0"}


async def test_a_gateway_replica_writes_only_its_own_record_in_the_demand_status(monkeypatch):
    patches = []

    async def patch_demand_status(namespace: str, name: str, patch: dict) -> None:
        patches.append((namespace, name, patch))

    monkeypatch.setattr(kube, "patch_demand_status", patch_demand_status)
    await demand_recorder("gateway-7f9c")(("team", "chat"), Demand(held=2, at=1_800_000_000.0))
    record = {"held": 2, "at": "2027-01-15T08:00:00Z"}
    assert patches == [("team", "chat", {"gateways": {"gateway-7f9c": record}})]
