"""Gateway fixtures: EndpointSlice bodies, a gateway on a real port, two real `llmpool serve`s.

The serving fixtures of tests/server are loaded from their file (tests/ is not a package under
``--import-mode=importlib``), so both suites start servers the same way.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from llmpool.fleet_key import pool_engine_key
from llmpool.gateway.app import Gateway, GatewaySettings, build_app
from llmpool.gateway.demand import DemandWriter
from llmpool.gateway.pools import PoolTable
from llmpool.gateway.tenants import KeyRing
from llmpool.operator import naming

_spec = importlib.util.spec_from_file_location(
    "llmpool_server_fixtures", Path(__file__).resolve().parents[1] / "server" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
server_fixtures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = server_fixtures  # its dataclasses look their module up there
_spec.loader.exec_module(server_fixtures)

GATEWAY_START_TIMEOUT_S = 30
FLEET_KEY = b"a fleet key for tests"
# Two pools in two namespaces, one served name: each served by a real engine that requires
# its pool's engine key (``keyed_engines``).
KEYED_POOLS = (("team-a", "chat"), ("team-b", "chat"))


def endpoint_slice(
    service: str,
    name: str,
    endpoints: list[tuple[str, str, bool | dict[str, bool] | None]],
    *,
    namespace: str = "team-a",
    port: int = naming.ENGINE_PORT,
) -> dict[str, Any]:
    """An EndpointSlice as the API server returns it; ``endpoints``: (pod, address, ready) each,
    ready None leaving the condition unset, a dict giving every condition."""
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "ports": [{"name": naming.ENGINE_PORT_NAME, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [address],
                "conditions": (
                    {} if ready is None else ready if isinstance(ready, dict) else {"ready": ready}
                ),
                "targetRef": {"kind": "Pod", "name": pod, "namespace": namespace},
            }
            for pod, address, ready in endpoints
        ],
    }


@pytest.fixture(scope="session")
def make_slice() -> Callable[..., dict[str, Any]]:
    return endpoint_slice


@pytest.fixture
def unused_port() -> int:
    """A port nothing listens on: a replica that is down."""
    return server_fixtures.free_port()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{'name{label="v",...}': value}`` with labels sorted."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway
    server: uvicorn.Server
    thread: threading.Thread

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def call(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback`` on the gateway's event loop (the only thread that touches its table)."""
        self.server.servers[0].get_loop().call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., RunningGateway]]:
    """Serves a table the test filled (marked synced) on 127.0.0.1; stopped after the test."""
    started: list[RunningGateway] = []

    def start(
        table: PoolTable,
        settings: GatewaySettings | None = None,
        demand_writer: DemandWriter | None = None,
        keys: KeyRing | None = None,
    ) -> RunningGateway:
        table.synced = True
        app = build_app(
            table, settings or GatewaySettings(), demand_writer=demand_writer, keys=keys
        )
        port = server_fixtures.free_port()
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)
        running = RunningGateway(f"http://127.0.0.1:{port}", app.state.gateway, server, thread)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def start_engine() -> Callable[..., Any]:
    """``start_server`` of tests/server: a real `llmpool serve` for a test to stop as it likes."""
    return server_fixtures.start_server


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Two real engine servers of the built-in model, as two replicas of one pool."""
    args = [
        "--max-model-len", "1024", "--max-num-seqs", "16", "--kv-cache-memory", "64MiB",
        "--no-access-log",
    ]  # fmt: skip
    folder = tmp_path_factory.mktemp("replicas")
    servers = [
        server_fixtures.start_server(
            [*args, "--replica-name", f"replica-{i}"], folder / f"replica-{i}.log"
        )
        for i in range(2)
    ]
    yield servers
    for server in servers:
        if server.process.poll() is None:
            server.terminate()


@pytest.fixture(scope="session")
def keyed_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Any]]:
    """A real engine per pool of ``KEYED_POOLS``, each with ``--api-key`` its pool's engine key
    derived from ``FLEET_KEY``, as the operator starts them."""
    folder = tmp_path_factory.mktemp("keyed")

    def start(namespace: str, pool: str) -> Any:
        args = [
            "--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-memory", "32MiB",
            "--no-access-log", "--api-key", pool_engine_key(FLEET_KEY, namespace, pool),
        ]  # fmt: skip
        return server_fixtures.start_server(args, folder / f"{namespace}-{pool}.log")

    with ThreadPoolExecutor(len(KEYED_POOLS)) as executor:  # both load at once
        started = [executor.submit(start, *key) for key in KEYED_POOLS]
        engines = dict(zip(KEYED_POOLS, (future.result() for future in started), strict=True))
    yield engines
    for engine in engines.values():
        if engine.process.poll() is None:
            engine.terminate()


@pytest.fixture(scope="session")
def fleet_key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fleet") / "fleet-key"
    path.write_bytes(FLEET_KEY + b"\n")
    return path
