"""A pool's load for the autoscaler: engine gauges of its ready pods plus the gateway's holds."""

from __future__ import annotations

import httpx

from llmpool.load import DEMAND_ANNOTATION, DEMAND_TTL_SECONDS, Demand
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


def test_demand_adds_fresh_holds_only() -> None:
    now = 1_800_000_000.0
    fresh = {DEMAND_ANNOTATION: Demand(held=4, at=now - 1).to_annotation()}
    stale = {DEMAND_ANNOTATION: Demand(held=4, at=now - DEMAND_TTL_SECONDS - 1).to_annotation()}
    assert pool_demand({"a": 5.0, "b": 1.0}, fresh, now) == 10.0
    assert pool_demand({"a": 5.0, "b": 1.0}, stale, now) == 6.0
    assert pool_demand({}, None, now) == 0.0


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
