"""Zero loss through the gateway while replicas stop: real engines drained by SIGTERM under steady
load, the routing table changed the way EndpointSlices change (late), and every request counted.

Phases, as a rollout, a scale-down and a deleted pod produce them:
1. steady: two replicas serve;
2. one replica stops before its endpoint is marked terminating (the race a preStop sleep
   narrows): new requests it refuses with a 503 are retried on the other, what it holds finishes;
3. the only replica left stops while its replacement is still loading: requests are held until
   the replacement is in the table, then served.
Every request must answer 200 with every token it asked for; streams must end with ``[DONE]``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from llmpool.gateway.app import GatewaySettings
from llmpool.gateway.pools import Pool, PoolTable

MODEL = "smollm2-135m-instruct"
NAMESPACE = "team-a"
POOL = "chat"
TOKENS = 16
CLIENTS = 4
ENGINE_ARGS = [
    "--max-model-len", "512", "--max-num-seqs", "16", "--kv-cache-memory", "64MiB",
    "--no-access-log", "--shutdown-timeout", "120",
]  # fmt: skip
STOPPING = {"ready": False, "serving": True, "terminating": True}


class Load:
    """``CLIENTS`` threads sending requests back to back (every other one streamed), each result
    counted under the phase current when the request was sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.phase = "steady"
        self.results: Counter[tuple[str, str]] = Counter()
        self.latencies: dict[str, list[float]] = {}
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def run(self, client: int) -> None:
        sent = 0
        with httpx.Client(timeout=300) as http:
            while not self._stop.is_set():
                phase, stream = self.phase, sent % 2 == 1
                started = time.monotonic()
                outcome = self._one(http, f"Client {client} asks question {sent}:", stream)
                with self._lock:
                    self.latencies.setdefault(phase, []).append(time.monotonic() - started)
                    self.results[(phase, "ok" if outcome is None else "failed")] += 1
                    if outcome is not None:
                        self.failures.append(f"{phase}: {outcome}")
                sent += 1

    def _one(self, http: httpx.Client, prompt: str, stream: bool) -> str | None:
        """None when the answer is whole, else what was wrong with it."""
        body = {
            "model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "min_tokens": TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": stream,
        }  # fmt: skip
        if not stream:
            response = http.post(f"{self.url}/v1/completions", json=body)
            if response.status_code != 200:
                return f"{response.status_code} {response.text[:200]}"
            tokens = response.json()["usage"]["completion_tokens"]
            return None if tokens == TOKENS else f"{tokens} tokens"
        body["stream_options"] = {"include_usage": True}
        events = []
        with http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"{response.status_code} {response.read()[:200]!r}"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream cut: {events[-2:]}"
        last = json.loads(events[-2])
        if "error" in last or (last.get("usage") or {}).get("completion_tokens") != TOKENS:
            return f"stream ended with {events[-2][:200]}"
        return None

    def stop(self) -> None:
        self._stop.set()

    def count(self, phase: str) -> int:
        with self._lock:
            return self.results[(phase, "ok")] + self.results[(phase, "failed")]


def wait_for(what: str, condition: Callable[[], Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def report(load: Load, metrics: dict[str, float]) -> None:
    """Each phase's outcomes and latencies, and the gateway's retries, in the test's output."""
    retried = sum(v for k, v in metrics.items() if 'decision="retry"' in k and "_total" in k)
    for phase, latencies in load.latencies.items():
        ok, failed = load.results[(phase, "ok")], load.results[(phase, "failed")]
        latencies.sort()
        print(
            f"{phase}: {ok} ok, {failed} failed; latency p50 {latencies[len(latencies) // 2]:.1f}"
            f" s, max {latencies[-1]:.1f} s"
        )
    print(f"retried on another replica: {retried:.0f}")


def test_stopping_replicas_under_load_fails_no_request(
    start_engine, make_slice, start_gateway, tmp_path: Path
) -> None:
    engines = {name: start_engine(ENGINE_ARGS, tmp_path / f"{name}.log") for name in ("a", "b")}
    table = PoolTable()
    table.set_pool(
        Pool(NAMESPACE, POOL, MODEL, "interactive", True, pinned_digest=None, drifted=frozenset())
    )

    def endpoint(name: str, port: int, conditions: dict[str, bool] | bool = True) -> dict:
        return make_slice(POOL, name, [(name, "127.0.0.1", conditions)], namespace=NAMESPACE,
                          port=port)  # fmt: skip

    for name, engine in engines.items():
        table.set_slice(endpoint(name, engine.port))
    gateway = start_gateway(table, GatewaySettings(scrape_interval=0.5, hold_timeout=240))
    load = Load(gateway.url)
    try:
        with ThreadPoolExecutor(CLIENTS + 1) as pool:
            clients = [pool.submit(load.run, client) for client in range(CLIENTS)]
            try:
                wait_for("steady traffic", lambda: load.count("steady") >= 2 * CLIENTS, 120)

                # A replica stops; the gateway hears of it only once it has exited.
                load.phase = "one of two stops"
                engines["a"].process.send_signal(signal.SIGTERM)
                assert engines["a"].process.wait(180) == 0
                gateway.call(table.set_slice, endpoint("a", engines["a"].port, STOPPING))
                wait_for("traffic on the other", lambda: load.count("one of two stops") >= 8, 120)

                # The last replica stops while its replacement loads.
                load.phase = "the only one is replaced"
                replacing = pool.submit(start_engine, ENGINE_ARGS, tmp_path / "c.log")
                engines["b"].process.send_signal(signal.SIGTERM)
                assert engines["b"].process.wait(180) == 0
                gateway.call(table.set_slice, endpoint("b", engines["b"].port, STOPPING))
                engines["c"] = replacing.result(timeout=300)
                gateway.call(table.set_slice, endpoint("c", engines["c"].port))
                wait_for(
                    "traffic on the replacement",
                    lambda: load.count("the only one is replaced") >= 2 * CLIENTS,
                    120,
                )
            finally:
                load.stop()
                for running in clients:
                    running.result(timeout=300)
        assert engines["c"].process.poll() is None  # the replacement serves on
    finally:
        for engine in engines.values():
            if engine.process.poll() is None:
                engine.terminate()
    report(load, gateway.metrics())
    assert load.failures == []
    assert all(outcome == "ok" for _, outcome in load.results)
