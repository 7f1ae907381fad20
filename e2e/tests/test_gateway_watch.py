"""A gateway whose API-server connections go silent recovers, and says it was stale meanwhile.

The gateway reaches the real API server through a TCP relay that the test can turn into a black
hole: every connection open at that moment, and every new one, is kept open and fed nothing,
as when a NAT entry or a load balancer drops a connection without a FIN or RST. That is the
failure a watch cannot see by itself; only its timeouts end it. For 60 s the gateway's table
is frozen: `/ready` must say `stale`. Changes made meanwhile (a pool deleted, another created)
must reach the table once connections get through again, and `/ready` turn 200.

No engine pod is needed: a pool that scales from zero is listed by the gateway from its spec.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml
from harness import ClusterHandle, GatewayProcess, wait_for

from llmpool.operator import naming

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MAX_TABLE_AGE_SECONDS = 20  # the gateway's --max-table-age here (90 by default)
SILENT_SECONDS = 60
# After the relay heals, a call hung on a dead connection ends by its read timeout (a watch's
# 30 + 10 s at most), the loop waits 2 s and lists again.
RECOVER_SECONDS = 90


class BlackHoleRelay:
    """Relays TCP from a local port to ``target``; ``silence()`` makes every connection open then,
    and every one accepted until ``heal()``, swallow whatever it receives and send nothing."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._silent = False
        self._dead: set[int] = set()  # ids of connections that swallow everything, forever
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        with self._lock:
            self._silent = True
            self._dead.update(id(s) for s in self._sockets)

    def heal(self) -> None:
        """New connections go through again; the ones that went silent stay so."""
        with self._lock:
            self._silent = False

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
                if self._silent:
                    self._dead.add(id(client))
                    threading.Thread(target=self._pump, args=(client, None), daemon=True).start()
                    continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets.append(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket | None) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    dead = sink is None or id(source) in self._dead or id(sink) in self._dead
                if not dead:
                    assert sink is not None
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                if sock is not None:
                    with self._lock:
                        silent = id(sock) in self._dead
                    if not silent:  # a dead connection never closes: no FIN reaches the client
                        sock.close()


def relayed_kubeconfig(cluster: ClusterHandle, relay_port: int, path: Path) -> Path:
    """The cluster's kubeconfig with the API server's address replaced by the relay's."""
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for entry in config["clusters"]:
        url = urlsplit(entry["cluster"]["server"])
        entry["cluster"]["server"] = urlunsplit(url._replace(netloc=f"127.0.0.1:{relay_port}"))
    path.write_text(yaml.safe_dump(config))
    return path


def api_server_address(cluster: ClusterHandle) -> tuple[str, int]:
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    url = urlsplit(config["clusters"][0]["cluster"]["server"])
    assert url.hostname and url.port, url
    return url.hostname, url.port


def pool(name: str, served: str) -> dict[str, Any]:
    """A pool that scales from zero: the gateway lists it without any replica."""
    documents = yaml.safe_load_all((ROOT / "examples" / "smollm2-interactive.yaml").read_text())
    body = next(d for d in documents if d and d["kind"] == naming.KIND)
    body["metadata"] = {"name": name}
    spec = body["spec"]
    spec.pop("replicas")
    spec.pop("chatTemplate")
    spec["model"]["servedName"] = served
    spec["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1}
    return body


def models(gateway: GatewayProcess) -> set[str]:
    status, body = gateway.get("/v1/models")
    assert status == 200, body
    return {m["id"] for m in json.loads(body)["data"]}


@pytest.fixture
def relay(cluster: ClusterHandle) -> Iterator[BlackHoleRelay]:
    relay = BlackHoleRelay(api_server_address(cluster))
    yield relay
    relay.close()


def test_a_silently_dropped_watch_is_reported_stale_and_recovered(
    cluster: ClusterHandle, namespace: str, relay: BlackHoleRelay, tmp_path: Path
) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=established", f"crd/{naming.PLURAL}.{naming.GROUP}")
    cluster.apply(pool("before", "model-before"), namespace=namespace)
    env = {
        **cluster.env,
        "KUBECONFIG": str(relayed_kubeconfig(cluster, relay.port, tmp_path / "kubeconfig")),
    }
    gateway = GatewayProcess(
        cluster, namespace, tmp_path / "gateway.log", 0,
        "--max-table-age", str(MAX_TABLE_AGE_SECONDS), env=env,
    )  # fmt: skip
    try:
        wait_for("the gateway to list the pool", lambda: "model-before" in models(gateway), 30, 1)

        relay.silence()
        silenced = time.monotonic()
        # The API server itself is fine: the changes land, the gateway cannot see them.
        cluster.kubectl("delete", "llmpool", "before", "-n", namespace)
        cluster.apply(pool("after", "model-after"), namespace=namespace)

        def stale() -> dict[str, Any] | None:
            status, body = gateway.get("/ready")
            return json.loads(body) if status == 503 else None

        report = wait_for("/ready to say stale", stale, MAX_TABLE_AGE_SECONDS + 30, 1)
        stale_after = time.monotonic() - silenced
        assert report["status"] == "stale", report
        assert report["tableAgeSeconds"] >= MAX_TABLE_AGE_SECONDS, report
        # Meanwhile the gateway answers from the table it has: it does not invent changes.
        assert models(gateway) == {"model-before"}
        time.sleep(max(0.0, SILENT_SECONDS - (time.monotonic() - silenced)))
        assert gateway.get("/ready")[0] == 503, "the table cannot have been refreshed"

        relay.heal()
        healed = time.monotonic()
        wait_for("/ready 200 again", lambda: gateway.get("/ready")[0] == 200, RECOVER_SECONDS, 1)
        recovered_after = time.monotonic() - healed
        wait_for(
            "the table to show the changes",
            lambda: models(gateway) == {"model-after"},
            RECOVER_SECONDS,
            1,
        )
        print(
            f"\nrelay silent for {SILENT_SECONDS}s: /ready said stale after {stale_after:.0f}s;"
            f" 200 again {recovered_after:.0f}s after the relay healed, with the changes made"
            " while it was silent"
        )
    finally:
        gateway.stop()
