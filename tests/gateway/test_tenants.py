"""Keys, tenants, limits and model names as pure parts: Secrets read, buckets on a clock that the
test moves, the cost of a request, and names resolved within a tenant's scope."""

from __future__ import annotations

import base64
import logging
from typing import Any

import pytest

from llmpool.gateway import routing
from llmpool.gateway.limits import TenantLimiter, TenantLimits, TokenBucket
from llmpool.gateway.pools import Pool
from llmpool.gateway.request import read_facts, upstream_body
from llmpool.gateway.tenants import DEFAULT, OPEN, KeyRing, tenant_from_secret
from llmpool.protocol.errors import APIError


def secret(name: str, **data: str) -> dict[str, Any]:
    encoded = {k.replace("_", "-"): base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"metadata": {"name": name}, "data": encoded}


def pool(namespace: str, name: str, served_name: str, **fields: Any) -> Pool:
    values: dict[str, Any] = {
        "priority_class": "interactive", "ready": True, "pinned_digest": None,
        "drifted": frozenset(),
    }  # fmt: skip
    return Pool(namespace, name, served_name, **{**values, **fields})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_secret_binds_a_key_to_a_tenant_scope_and_limits() -> None:
    digest, tenant = tenant_from_secret(
        secret("team-a-key", api_key=" k1\n", scope="team-a, team-b/chat", tokens_per_minute="9")
    )
    assert len(digest) == 32 and b"k1" not in digest
    assert tenant.name == "team-a-key"
    assert tenant.scope == {"team-a", "team-b/chat"}
    assert tenant.limits == TenantLimits(tokens_per_minute=9)
    assert tenant.may_use(pool("team-a", "any", "m"))
    assert tenant.may_use(pool("team-b", "chat", "m"))
    assert not tenant.may_use(pool("team-b", "batch", "m"))
    _, named = tenant_from_secret(secret("s", api_key="k", scope="*", tenant="research"))
    assert named.name == "research" and named.may_use(pool("anywhere", "p", "m"))


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"scope": "team-a"}, "api-key"),
        ({"api_key": "k"}, "scope"),
        ({"api_key": "k", "scope": "a", "max_held": "many"}, "max-held"),
        ({"api_key": "k", "scope": "a", "max_concurrent": "-1"}, "max-concurrent"),
    ],
)
def test_a_secret_that_does_not_say_enough_is_refused_by_field(
    data: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        tenant_from_secret(secret("s", **data))


def test_modes_open_one_key_and_secrets_with_rotation(caplog: pytest.LogCaptureFixture) -> None:
    assert KeyRing().authenticate(None) is OPEN
    one = KeyRing("s3cret")
    assert one.authenticate("Bearer s3cret") is DEFAULT
    for header in (None, "", "Bearer", "Bearer wrong", "Basic s3cret", "s3cret"):
        with pytest.raises(APIError) as error:
            one.authenticate(header)
        assert (error.value.status, error.value.code) == (401, "invalid_api_key")

    ring = KeyRing("admin", from_secrets=True)
    with pytest.raises(APIError):
        ring.authenticate(None)  # no Secret yet: not open
    ring.reset_secrets([secret("a", api_key="k1", scope="team-a")])
    assert ring.authenticate("Bearer k1").name == "a"
    assert ring.authenticate("bearer admin") is DEFAULT
    ring.set_secret(secret("a", api_key="k2", scope="team-a"))  # rotated
    with pytest.raises(APIError):
        ring.authenticate("Bearer k1")
    assert ring.authenticate("Bearer k2").name == "a"
    with caplog.at_level(logging.WARNING):
        ring.set_secret(secret("a", api_key="k3"))  # broken: the key goes, logged by name only
    assert "ignoring API key Secret a" in caplog.text and "k3" not in caplog.text
    with pytest.raises(APIError):
        ring.authenticate("Bearer k2")
    ring.set_secret(secret("a", api_key="k2", scope="team-a"))
    ring.delete_secret("a")
    with pytest.raises(APIError):
        ring.authenticate("Bearer k2")


def test_a_bucket_refills_per_minute_and_says_when() -> None:
    clock = Clock()
    bucket = TokenBucket(60, clock)
    assert bucket.seconds_until(60) == 0
    bucket.take(60)
    assert bucket.seconds_until(1) == pytest.approx(1.0)
    clock.now += 30
    assert bucket.seconds_until(30) == 0
    clock.now += 600
    assert bucket.seconds_until(61) == pytest.approx(1.0)  # never more than a minute saved


def test_limits_refuse_with_429_and_release_once() -> None:
    clock = Clock()
    limiter = TenantLimiter(clock)
    limits = TenantLimits(max_concurrent=2, requests_per_minute=3, tokens_per_minute=100)
    first, second = limiter.admit("t", limits, 10), limiter.admit("t", limits, 10)
    with pytest.raises(APIError) as error:
        limiter.admit("t", limits, 10)
    assert (error.value.status, error.value.type) == (429, "concurrent_requests")
    first.release()
    first.release()  # a second release changes nothing
    limiter.admit("t", limits, 10)
    second.release()
    with pytest.raises(APIError) as error:
        limiter.admit("t", limits, 10)  # the fourth request within the minute
    assert error.value.type == "requests" and error.value.headers["Retry-After"] == "20"
    clock.now += 20
    limiter.admit("t", limits, 10)
    with pytest.raises(APIError) as error:
        limiter.admit("u", limits, 101)  # a prompt of more than a minute's worth, before reading
    assert error.value.type == "tokens" and error.value.headers["Retry-After"] == "60"
    admitted = limiter.admit("u", limits, 1)
    with pytest.raises(APIError) as error:
        admitted.reserve(101)  # its full estimate, once the body is read
    assert error.value.type == "tokens" and error.value.headers["Retry-After"] == "60"
    with limiter.held("u", TenantLimits(max_held=1)):
        with pytest.raises(APIError) as error, limiter.held("u", TenantLimits(max_held=1)):
            pass
        assert error.value.type == "held_requests"
    with limiter.held("u", TenantLimits(max_held=1)):
        pass  # released


def test_a_reservation_is_settled_against_the_usage() -> None:
    """90 reserved and 10 used gives 80 back; 60 reserved and 150 used takes 90 more, so the
    bucket owes 50 and the next request waits until the minute has refilled it."""
    clock = Clock()
    limiter = TenantLimiter(clock)
    limits = TenantLimits(tokens_per_minute=100)
    refunded = limiter.admit("t", limits, 0)
    refunded.reserve(90)
    refunded.settle(10)
    refunded.settle(0)  # settled once: a second settlement changes nothing
    over = limiter.admit("t", limits, 0)
    over.reserve(60)  # 90 left after the refund
    over.settle(150)
    assert over.settled == 150
    with pytest.raises(APIError) as error:
        limiter.admit("t", limits, 1)  # 100 - 10 - 150 = -60: 61 tokens short
    assert error.value.type == "tokens" and error.value.headers["Retry-After"] == "37"
    clock.now += 37
    limiter.admit("t", limits, 1)


def test_cost_counts_the_body_and_every_choice() -> None:
    raw = b'{"model": "m", "prompt": "hello", "n": 128, "max_tokens": 16}'
    facts = read_facts(raw, "/v1/completions", 1024)
    assert facts.cost == -(-len(raw) // 4) + 128 * 16
    batch = read_facts(b'{"model": "m", "prompt": ["a", "b"], "n": 2}', "/v1/completions", 1024)
    assert (batch.choices, batch.max_tokens) == (4, 16)  # completions default to 16 tokens
    chat = read_facts(
        b'{"model": "m", "messages": [], "max_completion_tokens": 7}', "/v1/chat/completions", 1
    )
    assert chat.max_tokens == 7
    with pytest.raises(APIError):
        read_facts(b'{"model": "m", "n": "many"}', "/v1/completions", 1)
    assert upstream_body(b'{"model": "ns/m", "prompt": "\xc3\xa9"}', "m", False) == (
        '{"model":"m","prompt":"é"}'.encode()
    )
    forced = upstream_body(b'{"model":"m","stream":true,"stream_options":{}}', "m", True)
    assert forced == b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'


def test_names_resolve_within_scope_and_ambiguity_is_never_a_sort_order_winner() -> None:
    chat_a, batch_a = pool("aaa", "chat", "m"), pool("aaa", "batch", "m", priority_class="batch")
    chat_b = pool("bbb", "chat", "m")
    only_b = pool("bbb", "secret", "s", ready=False, scales_from_zero=True)
    assert routing.resolve([chat_a, batch_a], "m") == ([chat_a, batch_a], None)  # one namespace
    with pytest.raises(routing.RoutingError) as error:
        routing.resolve([chat_a, chat_b], "m")
    assert (error.value.status, error.value.code) == (400, routing.MODEL_AMBIGUOUS)
    assert "aaa/m" in str(error.value) and "bbb/m" in str(error.value)
    assert routing.resolve([chat_a, chat_b], "bbb/m") == ([chat_b], None)
    assert routing.model_ids([chat_a, batch_a, chat_b, only_b]) == ["aaa/m", "bbb/m", "s"]
    with pytest.raises(routing.RoutingError) as error:
        routing.resolve([chat_a], "bbb/m")
    assert (error.value.status, error.value.code) == (404, routing.MODEL_NOT_FOUND)
