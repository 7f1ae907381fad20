"""Relaying a replica that dies: before its response head (retried) and mid-stream (error event).

The replicas are fakes on raw sockets, so each test decides exactly when the connection breaks:
a clean close (FIN) in the middle of a chunked body, or a reset (RST).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest

from llmpool.gateway.app import GatewaySettings
from llmpool.gateway.pools import Pool, PoolTable

MODEL = "fake"
NAMESPACE = "team-a"
QUIET = GatewaySettings(scrape_interval=3600)
FIRST_EVENT = b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n\n'
ANSWER = b'{"choices": [{"index": 0, "text": "Hello"}]}'


class FakeReplica:
    """Answers GETs (the gateway's scrapes) with 404 and POSTs as ``behaviour`` says."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = (
            behaviour  # "answer", "drop-before-head", "close-mid-stream", "reset-mid-stream"
        )
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.posts = 0
        self.break_now = threading.Event()  # set by the test once the first event reached it
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            if head.startswith(b"GET"):
                conn.sendall(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                return
            self.posts += 1
            if self.behaviour == "answer":
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(ANSWER)}\r\nConnection: close\r\n\r\n".encode()
                    + ANSWER
                )
                return
            if self.behaviour == "drop-before-head":
                return  # closes with the request read and nothing answered
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                + f"{len(FIRST_EVENT):x}\r\n".encode()
                + FIRST_EVENT
                + b"\r\n"
            )
            self.break_now.wait(10)
            if self.behaviour == "reset-mid-stream":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_replicas() -> Iterator[Callable[[str], FakeReplica]]:
    made: list[FakeReplica] = []

    def make(behaviour: str) -> FakeReplica:
        made.append(FakeReplica(behaviour))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


def table(make_slice, replicas: dict[str, FakeReplica]) -> PoolTable:
    entry = Pool(
        namespace=NAMESPACE, name="pool", served_name=MODEL, priority_class="interactive",
        ready=True, pinned_digest=None, drifted=frozenset(),
    )  # fmt: skip
    result = PoolTable()
    result.set_pool(entry)
    for name, replica in replicas.items():
        endpoints = [(name, "127.0.0.1", True)]
        result.set_slice(
            make_slice("pool", name, endpoints, namespace=NAMESPACE, port=replica.port)
        )
    return result


@pytest.mark.parametrize("behaviour", ["close-mid-stream", "reset-mid-stream"])
def test_a_stream_broken_mid_way_ends_with_an_error_event(
    behaviour: str, make_slice, fake_replicas, start_gateway
) -> None:
    dying = fake_replicas(behaviour)
    gateway = start_gateway(table(make_slice, {"dying": dying}), QUIET)
    body = {"model": MODEL, "prompt": "Hello", "stream": True}
    events = []
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                events.append(line)
                dying.break_now.set()  # the gateway has relayed a byte: now the replica dies
    assert events[0] == FIRST_EVENT.decode().strip()
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_stream_broken")
    assert events[2:] == ["data: [DONE]"]  # nothing is retried once bytes reached the client
    metrics = gateway.metrics()
    labels = f'pool="{NAMESPACE}/pool",replica="dying"'
    assert metrics[f'llmpool_gateway:upstream_errors_total{{kind="stream",{labels}}}'] == 1
    assert metrics[f"llmpool_gateway:in_flight_requests{{{labels}}}"] == 0


def test_a_replica_that_drops_the_request_before_its_head_is_retried(
    make_slice, fake_replicas, start_gateway
) -> None:
    dying, healthy = fake_replicas("drop-before-head"), fake_replicas("answer")
    gateway = start_gateway(table(make_slice, {"dying": dying, "healthy": healthy}), QUIET)
    for tenant in range(6):  # the prefix keys rank both replicas first, some of them each
        body = {"model": MODEL, "prompt": f"Tenant {tenant}"}
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 200 and response.content == ANSWER
    assert healthy.posts == 6 and dying.posts >= 1
    metrics = gateway.metrics()
    labels = f'pool="{NAMESPACE}/pool",replica="dying"'
    assert (
        metrics[f'llmpool_gateway:upstream_errors_total{{kind="disconnected",{labels}}}']
        == dying.posts
    )
