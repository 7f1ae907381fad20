"""Held requests: the bounded hold queue, and the demand record the operator's autoscaler reads."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

from llmpool.gateway.app import GatewaySettings
from llmpool.gateway.demand import CHECK_SECONDS, SETTLE_SECONDS, DemandReporter
from llmpool.gateway.load import LoadTracker
from llmpool.gateway.pools import Pool, PoolKey, PoolTable
from llmpool.load import Demand

MODEL = "smollm2"
POOL = Pool("team-a", "smollm2-chat", MODEL, "interactive", False, None, frozenset(), True)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def ignore(key: PoolKey, demand: Demand) -> None:
    raise AssertionError("due() only decides; nothing is written here")


def test_the_first_hold_is_due_at_once_then_refreshed_then_cleared_once() -> None:
    table, tracker, clock = PoolTable(), LoadTracker(), Clock()
    table.set_pool(POOL)
    reporter = DemandReporter(table, tracker, ignore, refresh=5.0, clock=clock)
    assert reporter.due() == []  # nothing held, nothing written before: nothing to say

    def written() -> list[tuple[PoolKey, Demand]]:
        due = reporter.due()
        for key, demand in due:
            reporter._written[key] = demand  # as run() does after a successful write
        return due

    with tracker.held(POOL):
        assert written() == [(POOL.key, Demand(held=1, at=clock.now))]
        with tracker.held(POOL):
            clock.now += 1
            assert written() == []  # rate-limited: the record is fresh
            clock.now += 4
            assert written() == [(POOL.key, Demand(held=2, at=clock.now))]
    clock.now += 1
    assert written() == [(POOL.key, Demand(held=0, at=clock.now))]
    clock.now += 60
    assert written() == []


def test_a_held_request_is_recorded_and_a_full_hold_queue_is_a_503(start_gateway) -> None:
    """A pool with no replica: the first request waits and is recorded, the second is refused."""
    table = PoolTable()
    table.set_pool(POOL)
    records: list[tuple[PoolKey, Demand]] = []
    recorded, cleared = threading.Event(), threading.Event()

    async def record(key: PoolKey, demand: Demand) -> None:
        records.append((key, demand))
        (recorded if demand.held else cleared).set()

    gateway = start_gateway(table, GatewaySettings(hold_timeout=3, max_held=1), record)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    results: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: results.append(httpx.post(f"{gateway.url}/v1/completions", json=body))
    )
    first.start()
    assert recorded.wait(10), "the held request was not recorded"
    second = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
    assert second.status_code == 503 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "hold_queue_full"
    first.join(timeout=30)
    (held,) = results
    assert held.status_code == 503 and held.json()["error"]["code"] == "no_ready_replica"
    key, demand = records[0]
    assert key == POOL.key and demand.held == 1
    cleared.wait(10)  # once nothing is held, the record says so (once)
    assert [d.held for _, d in records] == [1, 0]


def test_a_scaled_to_zero_pool_is_listed(start_gateway) -> None:
    table = PoolTable()
    table.set_pool(POOL)
    gateway = start_gateway(table)
    listed = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [MODEL]


def test_fire_and_forget_requests_never_become_demand(start_gateway) -> None:
    """256 clients send a request for a pool at zero and hang up at once: each is admitted, held
    and dropped, and no demand is recorded, so the autoscaler leaves the pool at its minimum."""
    table = PoolTable()
    table.set_pool(POOL)
    records: list[Demand] = []

    async def record(key: PoolKey, demand: Demand) -> None:
        records.append(demand)

    gateway = start_gateway(table, GatewaySettings(hold_timeout=60, max_held=256), record)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: {len(body)}\r\n"
    request = (head + "Content-Type: application/json\r\n\r\n").encode() + body
    address = urlsplit(gateway.url)
    for _ in range(256):
        with socket.create_connection((address.hostname, address.port)) as client:
            client.sendall(request)

    def admitted() -> float:
        return gateway.metrics().get(
            'llmpool_gateway:tenant_requests_total{outcome="admitted",tenant="open"}', 0.0
        )

    deadline = time.monotonic() + 30
    while admitted() < 256 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert admitted() == 256
    while gateway.gateway.tracker.held_count(POOL) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gateway.gateway.tracker.held_count(POOL) == 0
    time.sleep(3 * (SETTLE_SECONDS + CHECK_SECONDS))  # every check that could have counted them
    assert [d.held for d in records if d.held] == []
