"""SIGTERM drains a real `llmpool serve`: not ready at once, new work refused with a retryable 503,
work in flight finished, and streams still open at the drain's deadline ended by an error event."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from pathlib import Path

import httpx

SERVER_ARGS = [
    "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--no-access-log", "--dtype", "float32",
]  # fmt: skip
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


def body(max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": stream, "temperature": 0,
    }  # fmt: skip


def stream_events(server, max_tokens: int, started: concurrent.futures.Future):
    """Every ``data:`` payload of a stream, as text; ``started`` is set at the first one."""
    events = []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body(max_tokens, True), timeout=300
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if not started.done():
                    started.set_result(time.monotonic())
    return events


def open_requests(server) -> float:
    metrics = server.metrics()
    return metrics["llmpool:num_requests_running"] + metrics["llmpool:num_requests_waiting"]


def wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigterm_refuses_new_work_and_finishes_what_is_in_flight(serve_process, tmp_path: Path):
    server = serve_process([*SERVER_ARGS, "--shutdown-timeout", "120"], tmp_path / "server.log")
    tokens = 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started: concurrent.futures.Future[float] = concurrent.futures.Future()
        streaming = pool.submit(stream_events, server, tokens, started)
        whole = pool.submit(
            httpx.post, f"{server.url}/v1/completions", json=body(tokens, False), timeout=300
        )
        started.result(timeout=120)
        wait_for(lambda: open_requests(server) == 2)
        server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{server.url}/ready", timeout=5).status_code == 503, 5)

        refused = httpx.post(f"{server.url}/v1/completions", json=body(4, False), timeout=30)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert open_requests(server) == 2, "both requests are still running during the drain"

        events = streaming.result(timeout=300)
        response = whole.result(timeout=300)
    assert events[-1] == "[DONE]"
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert len(choices) == tokens and choices[-1]["finish_reason"] == "length"
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == tokens
    assert server.process.wait(60) == 0, server.log()[-3000:]
    assert "drained" in server.log() and "Traceback" not in server.log()


def test_a_stream_open_at_the_drain_deadline_ends_with_an_error_event(
    serve_process, tmp_path: Path
):
    drain_seconds = 2
    server = serve_process(
        [*SERVER_ARGS, "--shutdown-timeout", str(drain_seconds)], tmp_path / "server.log"
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started: concurrent.futures.Future[float] = concurrent.futures.Future()
        streaming = pool.submit(stream_events, server, 2000, started)
        started.result(timeout=120)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        events = streaming.result(timeout=120)
    ended = time.monotonic() - signalled
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    tokens = [json.loads(event)["choices"][0] for event in events[:-2]]
    assert 0 < len(tokens) < 2000 and tokens[-1]["finish_reason"] is None
    assert drain_seconds <= ended < drain_seconds + 10
    assert server.process.wait(60) == 0, server.log()[-3000:]
