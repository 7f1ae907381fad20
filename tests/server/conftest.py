"""A real `llmpool serve` process on 127.0.0.1 per test module (its flags: the module's SERVER_ARGS)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families

LLMPOOL = str(Path(sys.executable).parent / "llmpool")
START_TIMEOUT_S = 300
MODEL = "smollm2-135m-instruct"

# The fuzz tests' hypothesis settings (``settings(settings.get_profile("llmpool-server"),
# max_examples=...)``): the same examples every run, so that a failure reproduces; no deadline,
# as the real server may take seconds to answer.
settings.register_profile(
    "llmpool-server",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One intra-op thread: the test machine's cores are shared, and oversubscribed torch
    # threads spin far slower than one.
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str = MODEL
    executable: str = LLMPOOL

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{'name{label="v",...}': value}`` (labels sorted, model_name left out)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).raise_for_status().text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Metrics once nothing runs or waits and the KV cache is empty again."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = (
                metrics["llmpool:num_requests_running"] == 0
                and metrics["llmpool:num_requests_waiting"] == 0
                and metrics["llmpool:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.2)

    def terminate(self, timeout: float = 120) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_server(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [LLMPOOL, "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(env),
        )
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"llmpool serve exited with {process.returncode}:\n{server.log()[-3000:]}"
            )
        try:
            if httpx.get(f"{server.url}/ready", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(
        f"llmpool serve was not ready after {START_TIMEOUT_S}s:\n{server.log()[-3000:]}"
    )


@pytest.fixture(scope="session")
def serve_process() -> Callable[..., ServerProcess]:
    """``start_server`` for tests that run their own servers."""
    return start_server


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    process = start_server(list(request.module.SERVER_ARGS), log_path)
    yield process
    if process.process.poll() is None:
        assert process.terminate() == 0, process.log()[-3000:]
