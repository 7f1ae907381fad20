"""Large bodies do not hold the gateway's event loop, and a tenant's limits are checked before
its body is read.

The gateway is real (uvicorn on a port) over a table with no pool, so every body is read,
parsed and answered 404 by the gateway itself. The parse is gated by the test, so that "while
bodies are being parsed" is a state the test holds, not a moment it hopes to catch.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llmpool.gateway import app as gateway_app
from llmpool.gateway.app import PARSE_OFF_LOOP_BYTES, GatewaySettings
from llmpool.gateway.pools import PoolTable
from llmpool.gateway.request import RequestFacts, read_facts
from llmpool.gateway.tenants import KeyRing

LARGE_BODIES, LARGE_BYTES = 4, 14_000_000
QUIET = GatewaySettings(scrape_interval=3600)
GATE_TIMEOUT_S = 60  # only a guard against a hung test: the gate is opened by the test


class GatedParse:
    """``read_facts`` that records which thread parsed each body, and holds each large one
    until the test opens the gate."""

    def __init__(self) -> None:
        self.parsed: list[tuple[int, threading.Thread]] = []
        self.large_started = threading.Semaphore(0)
        self.gate = threading.Event()

    def __call__(self, raw: bytes, path: str, prefix_chars: int) -> RequestFacts:
        self.parsed.append((len(raw), threading.current_thread()))
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            self.large_started.release()
            self.gate.wait(GATE_TIMEOUT_S)
        return read_facts(raw, path, prefix_chars)


@pytest.fixture
def gated_parse(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedParse]:
    gated = GatedParse()
    monkeypatch.setattr(gateway_app, "read_facts", gated)
    yield gated
    gated.gate.set()


def test_health_answers_while_large_bodies_are_parsed(start_gateway, gated_parse) -> None:
    gateway = start_gateway(PoolTable(), QUIET)
    large = json.dumps({"model": "absent", "prompt": "x" * LARGE_BYTES}).encode()
    small = {"model": "absent", "prompt": "hello"}

    def post_large(_: int) -> str:
        answer = httpx.post(f"{gateway.url}/v1/completions", content=large, timeout=120)
        return str(answer.json()["error"]["code"])

    with ThreadPoolExecutor(LARGE_BODIES) as executor:
        outcomes = executor.map(post_large, range(LARGE_BODIES))
        for _ in range(LARGE_BODIES):  # every large body read, and held in its parse
            assert gated_parse.large_started.acquire(timeout=GATE_TIMEOUT_S)
        # The loop is free: it answers /health, and parses a small body itself, meanwhile.
        assert httpx.get(f"{gateway.url}/health", timeout=30).json() == {"status": "ok"}
        answer = httpx.post(f"{gateway.url}/v1/completions", json=small, timeout=30)
        assert answer.json()["error"]["code"] == "model_not_found"
        held = [size for size, _ in gated_parse.parsed if size > PARSE_OFF_LOOP_BYTES]
        assert len(held) == LARGE_BODIES  # none of them finished before the small one
        gated_parse.gate.set()
        assert list(outcomes) == ["model_not_found"] * LARGE_BODIES
    on_loop = {size > PARSE_OFF_LOOP_BYTES for size, thread in gated_parse.parsed
               if thread is gateway.thread}  # fmt: skip
    assert on_loop == {False}  # the small body on the loop's thread, no large one


def _secret(**data: str) -> dict[str, Any]:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"metadata": {"name": "team-a"}, "data": encoded}


def _head_only(url: str, content_length: int, key: str) -> bytes:
    """POST a head that declares ``content_length`` bytes and send none of them: what the
    gateway answers without reading a body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n".encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not _whole(answer):
            data = conn.recv(65536)
            assert data, answer
            answer += data
        return answer


def _whole(answer: bytes) -> bool:
    head, body = answer.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return len(body) >= length


def test_a_tenant_over_its_limits_is_refused_before_its_body_is_read_and_limits_are_exported(
    start_gateway, gated_parse
) -> None:
    keys = KeyRing(from_secrets=True)
    keys.reset_secrets(
        [
            _secret(
                **{
                    "api-key": "key-a",
                    "scope": "*",
                    "requests-per-minute": "1",
                    "tokens-per-minute": "100000",
                }
            )
        ]  # fmt: skip
    )
    gateway = start_gateway(
        PoolTable(), GatewaySettings(scrape_interval=3600, replicas=3), keys=keys
    )
    # A prompt of 14 MB is more than 100,000 tokens a minute allow: refused from its head.
    refused = _head_only(gateway.url, LARGE_BYTES, "key-a")
    assert refused.startswith(b"HTTP/1.1 429") and b'"type":"tokens"' in refused, refused
    first = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "absent", "prompt": "hello"},
        headers={"Authorization": "Bearer key-a"},
        timeout=30,
    )
    assert first.json()["error"]["code"] == "model_not_found"
    refused = _head_only(gateway.url, 1000, "key-a")  # the minute's one request is spent
    assert refused.startswith(b"HTTP/1.1 429") and b'"type":"requests"' in refused, refused
    too_large = _head_only(gateway.url, 17 * 1024 * 1024, "no-such-key")
    assert too_large.startswith(b"HTTP/1.1 401"), too_large  # the key first, then the size
    assert len(gated_parse.parsed) == 1  # only the one body sent was parsed
    # Limits hold per replica: the bound through the three is exported beside each limit.
    metrics = gateway.metrics()
    assert metrics["llmpool_gateway:replicas"] == 3
    for limit, value in (("requests_per_minute", 1), ("tokens_per_minute", 100_000)):
        labels = f'{{limit="{limit}",tenant="team-a"}}'
        assert metrics[f"llmpool_gateway:tenant_limit{labels}"] == value
        assert metrics[f"llmpool_gateway:tenant_effective_limit{labels}"] == 3 * value
