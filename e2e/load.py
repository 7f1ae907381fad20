"""Steady load through the gateway that counts every answer that is not whole as failed.

Client threads send requests back to back (every other one streamed), each asking for exactly
``tokens`` tokens (``min_tokens`` = ``max_tokens``, ``ignore_eos``). A request fails on any
non-200, a wrong token count or finish reason, or a stream without ``[DONE]`` or with an error
event. Outcomes and latencies are kept per phase, the phase current when the request was sent.
Shared by the zero-loss e2e test and ``benchmarks/rollout.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict

import httpx


class Load:
    def __init__(self, url: str, model: str, tokens: int, timeout: float) -> None:
        self.url = url
        self.model = model
        self.tokens = tokens
        self.timeout = timeout
        self.phase = "steady"
        self.ok: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.failures: list[str] = []
        self.latencies: defaultdict[str, list[float]] = defaultdict(list)  # seconds, whole ones
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def run(self, client: int) -> None:
        """One client's loop, until ``stop()``."""
        sent = 0
        with httpx.Client(timeout=httpx.Timeout(self.timeout, connect=10)) as http:
            while not self._stop.is_set():
                phase, stream = self.phase, (client + sent) % 2 == 1
                prompt = f"Client {client} asks question {sent}:"
                began = time.monotonic()
                try:
                    problem = self._one(http, prompt, stream)
                except Exception as error:  # a malformed answer is a failure too
                    problem = f"{type(error).__name__}: {error}"
                with self._lock:
                    if problem is None:
                        self.ok[phase] += 1
                        self.latencies[phase].append(time.monotonic() - began)
                    else:
                        self.failed[phase] += 1
                        kind = "stream" if stream else "request"
                        self.failures.append(f"{phase}: {kind} {prompt!r}: {problem}")
                sent += 1

    def _one(self, http: httpx.Client, prompt: str, stream: bool) -> str | None:
        """None when the answer is whole, else what was wrong with it."""
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": self.tokens,
            "min_tokens": self.tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
        }  # fmt: skip
        if not stream:
            response = http.post(f"{self.url}/v1/completions", json=body)
            if response.status_code != 200:
                return f"{response.status_code} {response.text[:300]}"
            answer = response.json()
            tokens = answer["usage"]["completion_tokens"]
            reason = answer["choices"][0]["finish_reason"]
            whole = (tokens, reason) == (self.tokens, "length")
            return None if whole else f"{tokens} tokens, {reason}"
        body["stream_options"] = {"include_usage": True}
        with http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"{response.status_code} {response.read()[:300]!r}"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if len(events) < 2 or events[-1] != "[DONE]":
            return f"stream cut: {events[-2:]}"
        last = json.loads(events[-2])
        if "error" in last or (last.get("usage") or {}).get("completion_tokens") != self.tokens:
            return f"stream ended with {events[-2][:300]}"
        return None

    def start(self, phase: str) -> None:
        self.phase = phase

    def stop(self) -> None:
        self._stop.set()

    def count(self, phase: str) -> int:
        with self._lock:
            return self.ok[phase] + self.failed[phase]
