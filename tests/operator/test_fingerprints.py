"""Fetching /fingerprint from ready pods (HTTP mocked)."""

from __future__ import annotations

import json

import httpx

from llmpool.operator.fingerprints import engine_url, fetch_fingerprints, post_to_pod
from llmpool.operator.views import pod_view


async def test_fetches_ready_pods_and_reports_the_unreachable(make_pod):
    pods = [
        pod_view(make_pod("a", ip="10.0.0.1")),
        pod_view(make_pod("b", ip="10.0.0.2")),
        pod_view(make_pod("c", ip="10.0.0.3", ready=False)),
        pod_view(make_pod("d", ip="10.0.0.4", deleting=True)),
        pod_view(make_pod("e", ip=None)),
        pod_view(make_pod("f", ip="10.0.0.6")),
    ]
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "10.0.0.2":
            return httpx.Response(500)
        if request.url.host == "10.0.0.6":
            return httpx.Response(200, json=["not", "an", "object"])
        return httpx.Response(200, json={"digest": "sha256:x", "pinned": {}, "observed": {}})

    report = await fetch_fingerprints(pods, transport=httpx.MockTransport(answer))
    assert sorted(asked) == ["10.0.0.1", "10.0.0.2", "10.0.0.6"]
    assert [f.pod for f in report.fingerprints] == ["a"]
    assert report.fingerprints[0].template_digest == pods[0].digest
    assert report.fingerprints[0].body["digest"] == "sha256:x"
    assert set(report.unreachable) == {"b", "f"}


def test_urls():
    assert engine_url("10.1.2.3", "/fingerprint") == "http://10.1.2.3:8000/fingerprint"
    assert engine_url("fd00::1", "/fingerprint") == "http://[fd00::1]:8000/fingerprint"


async def test_posts_carry_the_pools_engine_key_when_there_is_one(make_pod):
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("authorization"), request.content))
        return httpx.Response(409, json={"error": {"code": "lora_slots_full"}})

    pod = pod_view(make_pod("a", ip="10.0.0.1"))
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    transport = httpx.MockTransport(answer)
    response = await post_to_pod(pod, "/v1/load_lora_adapter", body, "k3y", transport=transport)
    assert response.status_code == 409  # an answer is returned, whatever it says
    await post_to_pod(
        pod, "/v1/unload_lora_adapter", {"lora_name": "sql"}, None, transport=transport
    )
    assert seen[0][:2] == ("http://10.0.0.1:8000/v1/load_lora_adapter", "Bearer k3y")
    assert json.loads(seen[0][2]) == body
    assert seen[1][1] is None  # open mode: no key
