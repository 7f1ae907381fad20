"""Tenants through the gateway, in front of real engines that require their pool's engine key.

Two pools in two namespaces serve one name, each by its own `llmpool serve --api-key`; keys are
Secrets as the API server returns them, fed to the gateway's KeyRing as its watch does; calls
go through the official openai client.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmpool.fleet_key import FleetKey
from llmpool.gateway.app import GatewaySettings
from llmpool.gateway.pools import Pool, PoolTable
from llmpool.gateway.tenants import KeyRing

MODEL = "smollm2-135m-instruct"  # what `llmpool serve` serves without --served-model-name
PROMPT = "The capital of France is"


def secret(name: str, **data: str) -> dict[str, Any]:
    """A key Secret as the API server returns it (``max_held`` for the field ``max-held``)."""
    encoded = {k.replace("_", "-"): base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"metadata": {"name": name, "namespace": "llmpool-system"}, "data": encoded}


def pool(namespace: str, name: str = "chat", served_name: str = MODEL, **fields: Any) -> Pool:
    values: dict[str, Any] = {
        "namespace": namespace, "name": name, "served_name": served_name,
        "priority_class": "interactive", "ready": True, "pinned_digest": None,
        "drifted": frozenset(),
    }  # fmt: skip
    return Pool(**{**values, **fields})


def client(url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture
def tenancy(make_slice, keyed_engines, fleet_key_file: Path, start_gateway) -> Callable[..., Any]:
    """A gateway over team-a/chat and team-b/chat (the keyed engines), team-b/private (a model
    only team-b has) and team-a/idle (scales from zero, no replica); keys from ``secrets``."""

    def start(*secrets: dict[str, Any], hold_timeout: float = 30.0) -> Any:
        table = PoolTable()
        for (namespace, name), engine in keyed_engines.items():
            table.set_pool(pool(namespace, name))
            endpoints = [(f"{namespace}-{name}-0", "127.0.0.1", True)]
            table.set_slice(
                make_slice(name, name, endpoints, namespace=namespace, port=engine.port)
            )
        table.set_pool(pool("team-b", "private", served_name="private-model"))
        table.set_pool(pool("team-a", "idle", served_name="idle", scales_from_zero=True))
        keys = KeyRing(from_secrets=True)
        keys.reset_secrets(secrets)
        settings = GatewaySettings(
            fleet_key=FleetKey(fleet_key_file), scrape_interval=3600, hold_timeout=hold_timeout
        )
        return start_gateway(table, settings, keys=keys)

    return start


TEAM_A = secret("team-a", api_key="key-a", scope="team-a")
TEAM_B = secret("team-b", api_key="key-b", scope="team-b")
ADMIN = secret("admin", api_key="key-admin", scope="*")


def sent_to_pools(gateway: Any) -> dict[str, float]:
    totals: dict[str, float] = {}
    for key, value in gateway.metrics().items():
        if key.startswith("llmpool_gateway:requests_total{"):
            label = key.split('pool="', 1)[1].split('"', 1)[0]
            totals[label] = totals.get(label, 0.0) + value
    return totals


def test_each_key_reaches_only_its_own_pool(tenancy, keyed_engines, fleet_key_file) -> None:
    gateway = tenancy(TEAM_A, TEAM_B)
    for team, key in (("team-a", "key-a"), ("team-b", "key-b")):
        before = sent_to_pools(gateway).get(f"{team}/chat", 0)
        answer = client(gateway.url, key).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2
        )
        assert answer.choices[0].text
        assert sent_to_pools(gateway)[f"{team}/chat"] == before + 1
    assert [m.id for m in client(gateway.url, "key-a").models.list().data] == ["idle", MODEL]
    listed = [m.id for m in client(gateway.url, "key-b").models.list().data]
    assert listed == ["private-model", MODEL]

    # A model of another tenant answers exactly as one that does not exist.
    answers = {}
    for model in ("private-model", "team-b/private-model", "team-b/" + MODEL, "no-such-model"):
        with pytest.raises(openai.NotFoundError) as error:
            client(gateway.url, "key-a").completions.create(model=model, prompt=PROMPT)
        body = error.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found"
        answers[model] = body["message"].replace(repr(model), "MODEL")
    assert len(set(answers.values())) == 1, answers

    # The engines take only their pool's key: not a tenant's, not another pool's; so the
    # gateway sent each its own, and not the caller's.
    fleet = FleetKey(fleet_key_file)
    for pool_key, engine in keyed_engines.items():
        (other,) = set(keyed_engines) - {pool_key}
        for key in (None, "key-a", fleet.engine_key(*other)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            direct = httpx.post(
                f"{engine.url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
                headers=headers,
                timeout=30,
            )
            assert direct.status_code == 401, direct.text


def test_no_key_or_a_wrong_key_is_401(tenancy) -> None:
    gateway = tenancy(TEAM_A)
    for key in ("wrong", "key-b"):
        with pytest.raises(openai.AuthenticationError) as error:
            client(gateway.url, key).completions.create(model=MODEL, prompt=PROMPT)
        assert error.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "Basic key-a"}):
        answer = httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=10)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert (
        gateway.metrics()['llmpool_gateway:rejected_requests_total{reason="invalid_api_key"}'] == 4
    )


def test_a_name_claimed_in_two_visible_namespaces_is_ambiguous_until_qualified(tenancy) -> None:
    gateway = tenancy(ADMIN)
    admin = client(gateway.url, "key-admin")
    listed = [m.id for m in admin.models.list().data]
    assert listed == ["idle", "private-model", f"team-a/{MODEL}", f"team-b/{MODEL}"]
    with pytest.raises(openai.BadRequestError) as error:
        admin.completions.create(model=MODEL, prompt=PROMPT)
    body = error.value.body
    assert isinstance(body, dict) and body["code"] == "model_ambiguous"
    assert f"team-a/{MODEL}" in body["message"] and f"team-b/{MODEL}" in body["message"]
    for team in ("team-b", "team-a"):
        before = sent_to_pools(gateway).get(f"{team}/chat", 0)
        admin.completions.create(model=f"{team}/{MODEL}", prompt=PROMPT, max_tokens=1)
        assert sent_to_pools(gateway)[f"{team}/chat"] == before + 1


def test_a_rotated_key_works_at_once_and_the_old_one_no_more(tenancy) -> None:
    gateway = tenancy(TEAM_A)
    rotated = secret("team-a", api_key="key-a-2", scope="team-a")
    gateway.call(gateway.gateway.keys.set_secret, rotated)
    deadline = time.monotonic() + 10
    while (
        httpx.get(
            f"{gateway.url}/v1/models", headers={"Authorization": "Bearer key-a-2"}
        ).status_code
        != 200
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.AuthenticationError):
        client(gateway.url, "key-a").models.list()
    gateway.call(gateway.gateway.keys.delete_secret, "team-a")
    time.sleep(0.2)
    with pytest.raises(openai.AuthenticationError):
        client(gateway.url, "key-a-2").models.list()


def test_requests_and_tokens_per_minute_give_429_with_retry_after(tenancy) -> None:
    limited = secret("team-a", api_key="key-a", scope="team-a", requests_per_minute="2")
    tokens = secret("team-b", api_key="key-b", scope="team-b", tokens_per_minute="1000")
    gateway = tenancy(limited, tokens)
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        a = {"Authorization": "Bearer key-a"}
        assert [
            http.post("/v1/completions", json=body, headers=a).status_code for _ in range(2)
        ] == [200, 200]
        refused = http.post("/v1/completions", json=body, headers=a)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == "requests"
        assert 1 <= int(refused.headers["retry-after"]) <= 30  # one request refills in 30 s

        # n × max_tokens counts: 128 choices of 16 tokens are more than the minute allows.
        b = {"Authorization": "Bearer key-b"}
        fan_out = http.post("/v1/completions", json={**body, "n": 128, "max_tokens": 16}, headers=b)
        assert fan_out.status_code == 429 and fan_out.json()["error"]["type"] == "tokens"
        # 600 tokens are reserved at admission and settled when the answer is in: a request
        # the engine refuses (more than its 512 tokens of context) generated nothing and is
        # counted its prompt estimate, so a second one is admitted as well; a third of 900
        # would pass the minute's 1,000 with the first two's reservations, not their counts.
        for _ in range(2):
            spent = http.post("/v1/completions", json={**body, "max_tokens": 600}, headers=b)
            assert spent.json()["error"]["code"] == "context_length_exceeded"
        large = http.post("/v1/completions", json={**body, "max_tokens": 900}, headers=b)
        assert large.json()["error"]["code"] == "context_length_exceeded"
    metrics = gateway.metrics()
    outcome = 'llmpool_gateway:tenant_requests_total{outcome="%s",tenant="%s"}'
    assert metrics[outcome % ("admitted", "team-a")] == 2
    assert metrics[outcome % ("rate_limit_exceeded", "team-a")] == 1
    assert metrics[outcome % ("rate_limit_exceeded", "team-b")] == 1
    prompt_estimate = -(-len(compact({**body, "max_tokens": 600})) // 4)
    counted = metrics['llmpool_gateway:tenant_counted_tokens_total{tenant="team-b"}']
    assert counted == 3 * prompt_estimate  # the fan-out, refused before admission, counts nothing
    assert not any("key-" in name for name in metrics)  # tenants by name, never by key


def test_concurrent_requests_over_the_limit_are_429(tenancy) -> None:
    """A request counts from admission to the end of its answer; here one held for a pool
    without a replica, so that it lasts as long as its client waits."""
    gateway = tenancy(
        secret("team-a", api_key="key-a", scope="team-a", max_concurrent="1"), hold_timeout=60
    )
    a = {"Authorization": "Bearer key-a"}
    in_flight = 'llmpool_gateway:tenant_in_flight_requests{tenant="team-a"}'
    with httpx.Client(base_url=gateway.url, timeout=httpx.Timeout(60, read=1.5)) as waiting:
        held = {"model": "idle", "prompt": PROMPT, "max_tokens": 1}
        thread = threading.Thread(target=_post_until_read_timeout, args=(waiting, held, a))
        thread.start()
        _wait_until(lambda: gateway.metrics().get(in_flight) == 1)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        second = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=a, timeout=60)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["type"] == "concurrent_requests"
        thread.join(timeout=10)  # the first client gave up and left: its slot comes back
    _wait_until(lambda: gateway.metrics().get(in_flight) == 0)
    assert (
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers=a, timeout=60).status_code
        == 200
    )


def compact(body: dict[str, Any]) -> bytes:
    """``body`` as httpx sends ``json=``."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


# Both fields, as each route reads them: (max_tokens, max_completion_tokens) -> the limit the
# engine generates to (with ignore_eos, exactly that many tokens); None: until EOS (chat).
LIMIT_CASES = {
    "/v1/completions": [((None, None), 16), ((3, None), 3), ((None, 3), 3), ((4, 4), 4)],
    "/v1/chat/completions": [((None, None), None), ((3, None), 3), ((None, 3), 3), ((4, 4), 4)],
}


def _events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in text.split("\n\n")
        if line.startswith("data: {")
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", list(LIMIT_CASES))
def test_each_tenant_is_counted_the_usage_its_engine_returned(
    tenancy, path: str, stream: bool
) -> None:
    """For every combination of the two limit fields, the gateway reserves what the engine
    generates (estimate - prompt estimate = completion tokens), and then counts exactly the
    usage the engine returned; a stream is asked for its usage, which reaches only a client
    that asked for it. Two limits that differ are one 400 of the gateway's."""
    gateway = tenancy(TEAM_A)
    fields: dict[str, Any] = (
        {"prompt": PROMPT}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Say hello. One word."}], "stop": ["."]}
    )
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        for (max_tokens, max_completion_tokens), limit in LIMIT_CASES[path]:
            body: dict[str, Any] = {
                "model": MODEL, **fields, "temperature": 0, "ignore_eos": limit is not None,
            }  # fmt: skip
            for name, value in (
                ("max_tokens", max_tokens), ("max_completion_tokens", max_completion_tokens),
            ):  # fmt: skip
                if value is not None:
                    body[name] = value
            # Streamed: once asking for usage (the client sees it), once not (it does not; the
            # same greedy request, so the same usage).
            usage: dict[str, int] = {}
            for asked in (True, False) if stream else (True,):
                if stream:
                    body = {**body, "stream": True, "stream_options": {"include_usage": asked}}
                charged, reserved, answer = _counted(gateway, http, path, body)
                if stream:
                    usages = [e["usage"] for e in _events(answer.text) if e.get("usage")]
                    assert len(usages) == (1 if asked else 0), answer.text
                    usage = usages[0] if asked else usage
                else:
                    usage = answer.json()["usage"]
                print(f"{path} stream={stream} usage asked={asked} {body.get('max_tokens')=}"
                      f" {body.get('max_completion_tokens')=}: counted {charged:.0f},"
                      f" usage {usage['total_tokens']} ({usage})")  # fmt: skip
                assert charged == usage["total_tokens"]
                if limit is not None:
                    assert usage["completion_tokens"] == limit
                    assert reserved - -(-len(compact(body)) // 4) == limit
        differ = {**fields, "model": MODEL, "max_tokens": 3, "max_completion_tokens": 5}
        refused = http.post(path, content=compact(differ), headers=A_JSON)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] in ("max_tokens", "max_completion_tokens")
    assert sent_to_pools(gateway)["team-a/chat"] == len(LIMIT_CASES[path]) * (2 if stream else 1)


A_JSON = {"Authorization": "Bearer key-a", "Content-Type": "application/json"}


def test_a_client_that_leaves_a_stream_is_counted_its_reservation(tenancy) -> None:
    """No usage comes to a stream whose client left: what it reserved stands (every token its
    max_tokens allowed), never less, so leaving early is no way around the budget."""
    gateway = tenancy(TEAM_A)
    counted = 'llmpool_gateway:tenant_counted_tokens_total{tenant="team-a"}'
    estimated = 'llmpool_gateway:tenant_estimated_tokens_total{tenant="team-a"}'
    in_flight = 'llmpool_gateway:tenant_in_flight_requests{tenant="team-a"}'
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with (
        httpx.Client(base_url=gateway.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", content=compact(body), headers=A_JSON) as answer,
    ):
        events = answer.iter_lines()
        assert next(line for line in events if line.startswith("data: {"))
    _wait_until(lambda: gateway.metrics().get(in_flight) == 0)
    metrics = gateway.metrics()
    print(
        f"left after the first event: counted {metrics[counted]:.0f}, reserved {metrics[estimated]:.0f}"
    )
    assert metrics[counted] == metrics[estimated] == -(-len(compact(body)) // 4) + 400


def _counted(
    gateway: Any, http: httpx.Client, path: str, body: dict[str, Any]
) -> tuple[float, float, httpx.Response]:
    """The tokens team-a was counted and reserved for ``body``, and the answer."""
    counted = 'llmpool_gateway:tenant_counted_tokens_total{tenant="team-a"}'
    estimated = 'llmpool_gateway:tenant_estimated_tokens_total{tenant="team-a"}'
    before = gateway.metrics()
    answer = http.post(path, content=compact(body), headers=A_JSON)
    assert answer.status_code == 200, answer.text
    # Settled as the relayed response ends, a moment after its last byte reached the client.
    _wait_until(lambda: gateway.metrics().get(counted, 0) != before.get(counted, 0))
    after = gateway.metrics()
    return (
        after[counted] - before.get(counted, 0),
        after[estimated] - before.get(estimated, 0),
        answer,
    )


def _wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_held_requests_are_limited_per_tenant_and_dropped_when_the_client_leaves(
    tenancy,
) -> None:
    gateway = tenancy(
        secret("team-a", api_key="key-a", scope="team-a", max_held="1"), hold_timeout=60
    )
    idle = next(p for p in gateway.gateway.table.pools() if p.name == "idle")
    tracker = gateway.gateway.tracker
    a = {"Authorization": "Bearer key-a"}
    # n: 128 is one held request, not 128, for the autoscaler.
    body = {"model": "idle", "prompt": PROMPT, "max_tokens": 1, "n": 128}

    def wait_held(count: int) -> None:
        _wait_until(lambda: tracker.held_count(idle) == count)

    with httpx.Client(base_url=gateway.url, timeout=httpx.Timeout(60, read=1.5)) as http:
        thread = threading.Thread(
            target=lambda: _post_until_read_timeout(http, body, a), daemon=True
        )
        thread.start()
        wait_held(1)
        with httpx.Client(base_url=gateway.url, timeout=10) as other:
            refused = other.post("/v1/completions", json=body, headers=a)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "held_requests"
        thread.join(timeout=10)  # the client gave up after 1.5 s and closed its connection
    left_at = time.monotonic()
    wait_held(0)
    assert time.monotonic() - left_at < 30  # long before the 60 s hold timeout
    assert gateway.metrics()['llmpool_gateway:tenant_held_requests{tenant="team-a"}'] == 0


def _post_until_read_timeout(
    http: httpx.Client, body: dict[str, Any], headers: dict[str, str]
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, headers=headers)
