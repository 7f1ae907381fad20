"""The routing table's watches against an API server that misbehaves: a watch that dies silently
is ended by the client's timeout and re-listed, and an API server gone away makes /ready 503.

The API server is a small HTTP server speaking the list and watch protocol for LLMPools and
EndpointSlices; the official client, the watch loops and the gateway are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import kubernetes
import pytest

from llmpool.gateway import watch
from llmpool.gateway.app import Gateway, GatewaySettings
from llmpool.gateway.pools import PoolTable

NAMESPACE = "team-a"


class FakeApiServer(ThreadingHTTPServer):
    """Lists answer at once; every watch is accepted and then never answered nor closed (a
    connection that died without a FIN). ``down``: lists fail as a stopped API server's would."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lists: list[str] = []
        self.watches = 0
        self.down = False
        self.release = threading.Event()  # set at the end: hung watches return


class _Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if parse_qs(url.query).get("watch") == ["true"]:
            self.server.watches += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            self.server.release.wait(60)  # silent: no event, no end
            return
        if self.server.down:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.lists.append(url.path.rsplit("/", 1)[-1])
        kind = "LLMPoolList" if url.path.endswith("llmpools") else "EndpointSliceList"
        body = json.dumps({"kind": kind, "metadata": {"resourceVersion": "7"}, "items": []})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


@pytest.fixture
def api_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    previous = kubernetes.client.Configuration.get_default_copy()
    kubernetes.client.Configuration.set_default(configuration)
    # Seconds instead of tens of them: the server is asked to end a watch after 1 s and the
    # client gives up 1 s later; failures are retried after 0.1 s.
    monkeypatch.setattr(watch, "WATCH_TIMEOUT_SECONDS", 1)
    monkeypatch.setattr(watch, "WATCH_CLIENT_SLACK_SECONDS", 1)
    monkeypatch.setattr(watch, "RETRY_DELAY_SECONDS", 0.1)
    yield server
    server.release.set()
    server.shutdown()
    kubernetes.client.Configuration.set_default(previous)


async def wait_until(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_silently_dead_watch_is_ended_by_the_client_and_listed_again(api_server):
    table = PoolTable()
    watcher = watch.TableWatcher(table, watch.resources([NAMESPACE]))
    running = asyncio.create_task(watcher.run())
    try:
        await wait_until(lambda: table.synced)
        assert sorted(api_server.lists) == ["endpointslices", "llmpools"]
        # Each loop's watch hangs; the client's read timeout (2 s) ends it and the loop lists
        # again, so the table keeps hearing from the API server.
        await wait_until(lambda: len(api_server.lists) >= 4, timeout=10)
        assert api_server.watches >= 2
        assert table.age() < 5
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_ready_turns_503_while_the_table_is_stale_and_back_once_it_is_fresh(api_server):
    table = PoolTable()
    watcher = watch.TableWatcher(table, watch.resources([NAMESPACE]))
    gateway = Gateway(table, GatewaySettings(max_table_age=3))
    running = asyncio.create_task(watcher.run())
    try:
        await wait_until(lambda: table.synced)
        assert (await gateway.ready(None)).status_code == 200  # type: ignore[arg-type]
        api_server.down = True
        await wait_until(lambda: table.age() > 3, timeout=15)
        stale = await gateway.ready(None)  # type: ignore[arg-type]
        assert stale.status_code == 503
        assert json.loads(stale.body)["status"] == "stale"
        api_server.down = False
        await wait_until(lambda: table.age() < 3, timeout=15)
        assert (await gateway.ready(None)).status_code == 200  # type: ignore[arg-type]
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await gateway.client.aclose()
