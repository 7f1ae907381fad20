"""Requests by adapter name through the gateway app, in process: the replicas are an httpx mock
transport and their fingerprints are recorded by hand (no scrape, no socket)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest

from llmpool.gateway import routing
from llmpool.gateway.app import Gateway, GatewaySettings, build_app
from llmpool.gateway.pools import Pool, PoolTable
from llmpool.protocol.response_ids import TENANT_HEADER, new_response_id, replica_token

NAMESPACE = "team-a"
MODEL = "smollm2"
REVISION = "sha256:" + "5" * 64
OTHER_REVISION = "sha256:" + "6" * 64
REPLICAS = {"chat-0": "10.0.0.1", "chat-1": "10.0.0.2"}
HOLD_TIMEOUT = 10.0


class Replicas:
    """The replicas behind the mock transport: what each was sent (host -> bodies)."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[dict[str, Any]]] = {host: [] for host in REPLICAS.values()}

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.bodies[request.url.host].append(json.loads(request.content))
        # A stream, as a real connection gives it: the gateway relays it chunk by chunk.
        return httpx.Response(
            200,
            headers={"content-type": "application/json"},
            stream=httpx.ByteStream(b'{"choices": [{"index": 0, "text": "ok"}]}'),
        )


@pytest.fixture
async def gateway(
    make_slice: Callable[..., dict[str, Any]],
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, Replicas]]:
    pool = Pool(
        NAMESPACE, "chat", MODEL, "interactive", True, None, frozenset(),
        adapters={"sql": REVISION, "poet": REVISION},
    )  # fmt: skip
    table = PoolTable()
    table.set_pool(pool)
    endpoints = [(name, address, True) for name, address in REPLICAS.items()]
    table.set_slice(make_slice("chat", "s1", endpoints, namespace=NAMESPACE))
    table.synced = True
    app = build_app(table, GatewaySettings(hold_timeout=HOLD_TIMEOUT))
    gateway: Gateway = app.state.gateway
    replicas = Replicas()
    await gateway.client.aclose()
    gateway.client = httpx.AsyncClient(transport=httpx.MockTransport(replicas.answer))
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield gateway, client, replicas
    await gateway.client.aclose()


def loaded(gateway: Gateway, pod: str, adapters: dict[str, str]) -> None:
    """What a scrape of ``pod``'s /fingerprint records."""
    replica = next(r for r in gateway.table.all_replicas() if r.name == pod)
    gateway.tracker.record_fingerprint(replica, None, adapters)


def completion(model: str, prompt: str = "SELECT") -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4}


async def test_models_lists_the_adapters_with_their_parent(gateway) -> None:
    _, client, _ = gateway
    data = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [
        (MODEL, None),
        ("poet", MODEL),
        ("sql", MODEL),
    ]


async def test_an_adapter_goes_to_the_replica_with_its_pinned_revision_by_its_bare_name(
    gateway,
) -> None:
    gw, client, replicas = gateway
    loaded(gw, "chat-0", {"sql": OTHER_REVISION})  # other files under the name: not the pin
    loaded(gw, "chat-1", {"sql": REVISION})
    for i, model in enumerate(["sql", f"{NAMESPACE}/sql"] * 4):
        response = await client.post("/v1/completions", json=completion(model, f"Query {i}"))
        assert response.status_code == 200
    assert replicas.bodies["10.0.0.1"] == []
    assert [body["model"] for body in replicas.bodies["10.0.0.2"]] == ["sql"] * 8
    for i in range(12):  # the base model still goes to both
        response = await client.post("/v1/completions", json=completion(MODEL, f"Base {i}"))
        assert response.status_code == 200
    assert {body["model"] for body in replicas.bodies["10.0.0.1"]} == {MODEL}


async def test_a_request_for_an_adapter_not_loaded_yet_is_held_until_it_is(gateway) -> None:
    gw, client, replicas = gateway
    request = asyncio.ensure_future(client.post("/v1/completions", json=completion("poet")))
    await asyncio.sleep(0.1)
    assert not request.done()
    assert gw.tracker.held_count(gw.table.pools()[0]) == 1
    loaded(gw, "chat-0", {"poet": REVISION})
    # Woken by the fingerprint, long before the hold would have ended.
    response = await asyncio.wait_for(request, 2)
    assert response.status_code == 200
    assert [body["model"] for body in replicas.bodies["10.0.0.1"]] == ["poet"]


async def test_an_adapter_never_loaded_is_a_503_after_the_hold(gateway) -> None:
    gw, client, replicas = gateway
    gw.settings = dataclasses.replace(gw.settings, hold_timeout=0.3)
    loaded(gw, "chat-0", {"poet": OTHER_REVISION})
    response = await client.post("/v1/completions", json=completion("poet"))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == routing.ADAPTER_NOT_RESIDENT
    assert "retry-after" in response.headers
    assert replicas.bodies == {host: [] for host in REPLICAS.values()}


async def test_models_retrieve_by_id_and_route_errors_are_openai_shaped(gateway) -> None:
    _, client, _ = gateway
    api = openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key="unused", http_client=client, max_retries=0
    )
    assert (await api.models.retrieve("poet")).model_dump()["parent"] == MODEL
    assert (await api.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        await api.models.retrieve("absent")
    assert missing.value.body["param"] == "model" and "'absent'" in missing.value.message
    unknown = await client.post("/v1/nowhere", json={})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"
    wrong = await client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


async def test_responses_carry_the_tenant_and_stored_ids_go_to_their_replica(gateway) -> None:
    """The engine scopes stored responses by the tenant header: the gateway sets it, whatever the
    client sends; an id addressed request reaches only the replica its id names."""
    gw, client, _ = gateway
    seen: list[tuple[str, str, str | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.host, request.headers.get(TENANT_HEADER)))
        return httpx.Response(
            200,
            headers={"content-type": "application/json"},
            stream=httpx.ByteStream(b'{"object": "response", "output": []}'),
        )

    await gw.client.aclose()
    gw.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    forged = {TENANT_HEADER: "someone-else"}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    assert (await client.post("/v1/responses", json=body, headers=forged)).status_code == 200
    held = new_response_id(replica_token("chat-1"))
    pinned = {**body, "previous_response_id": held}
    for _ in range(3):
        assert (await client.post("/v1/responses", json=pinned)).status_code == 200
    assert (await client.get(f"/v1/responses/{held}", headers=forged)).status_code == 200
    assert (await client.delete(f"/v1/responses/{held}")).status_code == 200
    assert {tenant for _, _, tenant in seen} == {"open"}
    assert [(method, host) for method, host, _ in seen[1:]] == [
        ("POST", REPLICAS["chat-1"])] * 3 + [("GET", REPLICAS["chat-1"]), ("DELETE", REPLICAS["chat-1"])
    ]  # fmt: skip
    for unknown in (new_response_id(replica_token("gone-0")), "resp_x"):
        missing = await client.get(f"/v1/responses/{unknown}")
        assert missing.status_code == 404 and unknown in missing.json()["error"]["message"]
        lost = await client.post("/v1/responses", json={**body, "previous_response_id": unknown})
        assert lost.status_code == 404
        assert lost.json()["error"]["param"] == "previous_response_id"
