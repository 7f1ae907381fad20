"""The real `llmpool gateway` process under 30 concurrent 15 MB bodies stays under its chart
memory limit and keeps answering a small request from another tenant meanwhile.

The gateway runs as the chart runs it: its own process, tenants from labelled Secrets, the fleet
key from a file. Its API server is a small HTTP server that lists two pools (one served by a
real engine that requires its pool's key, one with no replica, where the large bodies are held)
and two key Secrets, and answers watches with nothing.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import yaml

from llmpool.operator import naming

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
BODIES, BODY_BYTES = 30, 15_000_000
HOLD_SECONDS = 8  # how long the large requests are held for a pool with no replica
READY = {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}]}


def chart_memory_limit() -> int:
    values = yaml.safe_load((ROOT / "charts" / "llmpool" / "values.yaml").read_text())
    limit = values["gateway"]["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    return int(limit[:-2]) * 1024 * 1024


def llmpool(namespace: str, name: str, served_name: str) -> dict[str, Any]:
    documents = yaml.safe_load_all((ROOT / "examples" / "smollm2-interactive.yaml").read_text())
    pool = next(d for d in documents if d["kind"] == naming.KIND)
    pool["metadata"] = {"name": name, "namespace": namespace}
    pool["spec"]["model"]["servedName"] = served_name
    pool["status"] = READY
    return pool


def key_secret(name: str, key: str) -> dict[str, Any]:
    data = {"api-key": key, "scope": "team-a"}
    return {
        "metadata": {"name": name, "namespace": "llmpool-system"},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


class StaticApiServer(ThreadingHTTPServer):
    """Lists what it was given; every watch ends after a second with no event."""

    daemon_threads = True

    def __init__(self, lists: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lists = lists  # the last path segment (llmpools, endpointslices, secrets) -> items


class _Handler(BaseHTTPRequestHandler):
    server: StaticApiServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if parse_qs(url.query).get("watch") == ["true"]:
            time.sleep(1)
            body = b""
        else:
            items = self.server.lists[url.path.rsplit("/", 1)[-1]]
            body = json.dumps({"metadata": {"resourceVersion": "1"}, "items": items}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway stopped while its watch was open


@pytest.fixture
def gateway_process(
    keyed_engines, fleet_key_file: Path, make_slice, unused_port: int, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    engine = keyed_engines[("team-a", "chat")]
    service = naming.service_name("chat")
    api = StaticApiServer(
        {
            "llmpools": [llmpool("team-a", "chat", MODEL), llmpool("team-a", "sink", "sink")],
            "endpointslices": [
                make_slice(service, "chat-x", [("chat-0", "127.0.0.1", True)], port=engine.port)
            ],
            "secrets": [key_secret("bulk", "key-bulk"), key_secret("small", "key-small")],
        }
    )
    threading.Thread(target=api.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{api.server_port}"}}
                ],
                "users": [{"name": "fake", "user": {"token": "unused"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "LLMPOOL_FLEET_KEY_FILE": str(fleet_key_file),
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = [
        sys.executable, "-m", "llmpool.cli", "gateway", "--host", "127.0.0.1",
        "--port", str(unused_port), "--namespace", "team-a", "--api-key-namespace", "llmpool-system",
        "--hold-timeout", str(HOLD_SECONDS), "--no-record-demand",
    ]  # fmt: skip
    with (tmp_path / "gateway.log").open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{unused_port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become ready"
        time.sleep(0.2)
    yield process, url
    process.terminate()
    process.wait(timeout=30)
    api.shutdown()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def buffered(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("llmpool_gateway:buffered_body_bytes "):
            return float(line.split()[1])
    raise AssertionError("no buffered_body_bytes gauge")


def test_thirty_15mb_bodies_stay_under_the_memory_limit_and_others_are_served(
    gateway_process,
) -> None:
    process, url = gateway_process
    limit = chart_memory_limit()
    peak = rss_bytes(process.pid)
    idle = peak
    sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not sampling.is_set():
            peak = max(peak, rss_bytes(process.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    prompt = "x" * (BODY_BYTES - 100)
    body = json.dumps({"model": "sink", "prompt": prompt, "max_tokens": 1}).encode()
    bulk = {"Authorization": "Bearer key-bulk", "Content-Type": "application/json"}

    def large(_: int) -> str:
        try:
            with httpx.Client(timeout=60) as http:
                answer = http.post(f"{url}/v1/completions", content=body, headers=bulk)
        except httpx.TransportError as error:  # refused before the whole body was sent
            return type(error).__name__
        return f"{answer.status_code} {answer.json()['error']['code']}"

    with ThreadPoolExecutor(BODIES) as executor:
        outcomes = executor.map(large, range(BODIES))
        deadline = time.monotonic() + 30
        while buffered(url) < 100 * 1024 * 1024:  # the bodies held for the sink pool
            assert time.monotonic() < deadline, "the large bodies were not held"
            time.sleep(0.05)
        small = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2},
            headers={"Authorization": "Bearer key-small"},
            timeout=30,
        )
        still_held = buffered(url)
        results = list(outcomes)
    sampling.set()
    sampler.join()
    print(
        f"gateway RSS idle {idle / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB under"
        f" {BODIES} x {BODY_BYTES:,} B bodies (limit {limit / 2**20:.0f} MiB); {results}"
    )
    assert small.status_code == 200, small.text
    assert still_held > 0  # answered while the large bodies were still held
    assert peak < limit
    held = results.count("503 no_ready_replica")
    assert held >= 1, results  # admitted, held, then answered when the hold timed out
    refused = [r for r in results if r != "503 no_ready_replica"]
    assert refused and all(r == "503 gateway_busy" or not r[0].isdigit() for r in refused), results
    assert process.poll() is None
