"""`llmpool bench serve --against`: one run against two OpenAI-compatible servers over HTTP.

The two servers stream as llmpool and as llama.cpp's `llama-server` do (usage in a chunk of its
own only when asked for, against an empty-text last chunk that always carries usage), so the test
checks that both get the same requests and are counted alike.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmpool.bench import serve


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the default 5 drops SYNs of concurrent requests: 1 s retries

    def __init__(self, shape: str) -> None:
        super().__init__(("127.0.0.1", 0), StreamingHandler)
        self.shape = shape
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def chunks(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        count = body["max_tokens"]
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": count}
        for index in range(count):
            last = self.shape == "llmpool" and index == count - 1
            yield {"choices": [{"text": f" t{index}", "finish_reason": "length" if last else None}]}
        if self.shape == "llama.cpp":
            yield {"choices": [{"text": "", "finish_reason": "length"}], "usage": usage}
        elif body.get("stream_options", {}).get("include_usage"):
            yield {"choices": [], "usage": usage}


class StreamingHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send(self, payload: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        model = {"id": f"{self.server.shape}-model", "object": "model"}
        self.send(json.dumps({"object": "list", "data": [model]}).encode(), "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in self.server.chunks(body)]
        self.send("".join([*events, "data: [DONE]\n\n"]).encode(), "text/event-stream")


@pytest.fixture
def servers() -> Iterator[tuple[FakeServer, FakeServer]]:
    pair = (FakeServer("llmpool"), FakeServer("llama.cpp"))
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in pair]
    for thread in threads:
        thread.start()
    yield pair
    for server in pair:
        server.shutdown()
        server.server_close()


def test_both_targets_get_the_same_requests_and_are_counted_alike(
    servers: tuple[FakeServer, FakeServer], tmp_path: Path
) -> None:
    ours, peer = servers
    argv = [
        "--url", ours.url, "--against", f"llama.cpp={peer.url}", "--concurrency", "1,4",
        "--num-prompts", "6", "--input-len", "4-12", "--output-len", "2-5",
        "--output-dir", str(tmp_path), "--name", "pair",
    ]  # fmt: skip
    assert serve.main(argv) == 0

    def requests(server: FakeServer) -> list[tuple[str, int]]:
        assert all(r["ignore_eos"] and r["stream"] for r in server.requests)
        return sorted((r["prompt"], r["max_tokens"]) for r in server.requests)

    assert len(ours.requests) == 1 + 12
    assert requests(ours) == requests(peer)

    report = json.loads((tmp_path / "pair.json").read_text())
    assert (report["name"], report["model"]) == ("llmpool", "llmpool-model")
    [against] = report["against"]
    assert (against["name"], against["model"]) == ("llama.cpp", "llama.cpp-model")
    for target in (report, against):
        assert [level["concurrency"] for level in target["levels"]] == [1, 4]
        for level in target["levels"]:
            assert (level["completed"], level["failed"]) == (6, 0)
            assert level["output_tokens_counted_by"] == "usage"
            assert 4 <= level["prompt_tokens_mean"] <= 12
    for mine, theirs in zip(report["levels"], against["levels"], strict=True):
        assert mine["prompt_tokens_mean"] == theirs["prompt_tokens_mean"]
        # Same tokens per request: the throughput ratio is only the two servers' speeds.
        tokens = mine["output_throughput"] * mine["duration_s"]
        assert tokens == pytest.approx(theirs["output_throughput"] * theirs["duration_s"])
    assert [r["concurrency"] for r in report["ratios"]["llama.cpp"]] == [1, 4]
    assert "### llmpool vs llama.cpp" in (tmp_path / "pair.md").read_text()
    assert (tmp_path / "pair.png").read_bytes().startswith(b"\x89PNG")
