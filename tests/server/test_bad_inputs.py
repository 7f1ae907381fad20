"""Whatever a client sends, it gets the right status and an OpenAI-shaped error; the server lives on."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_QUEUE = 100
SERVER_ARGS = [
    "--api-key", API_KEY, "--max-queue", str(MAX_QUEUE), "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "16", "--kv-cache-memory", "64MiB", "--no-access-log",
]  # fmt: skip
AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 50)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


BAD_BODIES = {
    "prompt wrong type": ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
    "prompt empty": ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    "max_tokens string": ("/v1/completions", {**COMPLETION, "max_tokens": "ten"}, "max_tokens"),
    "max_tokens negative": ("/v1/completions", {**COMPLETION, "max_tokens": -5}, "max_tokens"),
    "max_tokens zero": ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    "max_tokens huge": ("/v1/completions", {**COMPLETION, "max_tokens": 10**12}, "max_tokens"),
    "max_tokens float": ("/v1/completions", {**COMPLETION, "max_tokens": 2.5}, "max_tokens"),
    "temperature string": ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    "temperature negative": ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
    "top_p zero": ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
    "n zero": ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
    "n boolean": ("/v1/completions", {**COMPLETION, "n": True}, "n"),
    "stream string": ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
    "stop numbers": ("/v1/completions", {**COMPLETION, "stop": [1, 2]}, "stop"),
    "logprobs too many": ("/v1/completions", {**COMPLETION, "logprobs": 99}, "logprobs"),
    "token id out of vocabulary": ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, "prompt"),
    "lone surrogate": ("/v1/completions", {**COMPLETION, "prompt": "\ud800"}, "prompt"),
    "messages missing": ("/v1/chat/completions", {"model": MODEL}, "messages"),
    "messages empty": ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    "messages string": ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    "unknown role": (
        "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        "messages[0].role",
    ),
    "content wrong type": (
        "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]},
        "messages[0].content",
    ),
    "image part": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    "unknown priority class": ("/v1/completions", {**COMPLETION, "priority": "vip"}, "priority"),
    "cache_salt number": ("/v1/completions", {**COMPLETION, "cache_salt": 5}, "cache_salt"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    # Each of these used to reach the engine loop and kill it, or answered with torch's words.
    "stop token id beyond vocabulary": (
        "/v1/completions", {**COMPLETION, "min_tokens": 1, "stop_token_ids": [999999]}, "stop_token_ids",
    ),
    "stop token id negative": ("/v1/completions", {**COMPLETION, "stop_token_ids": [-3]}, "stop_token_ids"),
    "seed beyond 64 bits": ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed"),
    "priority beyond int32": ("/v1/completions", {**COMPLETION, "priority": 10**30}, "priority"),
    "priority above the pool's": ("/v1/completions", {**COMPLETION, "priority": -1}, "priority"),
    "temperature NaN": ("/v1/completions", {**COMPLETION, "temperature": float("nan")}, "temperature"),
    "top_p infinite": ("/v1/completions", {**COMPLETION, "top_p": float("inf")}, "top_p"),
    "penalty huge integer": ("/v1/completions", {**COMPLETION, "presence_penalty": 10**400}, "presence_penalty"),
    "logit_bias id beyond vocabulary": ("/v1/completions", {**COMPLETION, "logit_bias": {"999999": 5}}, "logit_bias"),
    "logit_bias key not an id": ("/v1/completions", {**COMPLETION, "logit_bias": {"hello": 5}}, "logit_bias"),
    "logit_bias value too large": ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias"),
    # Fields this server does not implement are refused by name, never silently ignored
    # (tools and structured outputs have their own cases in test_structured_outputs.py).
    "tools on completions": ("/v1/completions", {**COMPLETION, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "tool_choice without tools": ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    "functions": ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    "response_format unknown": ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    "suffix": ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    "echo": ("/v1/completions", {**COMPLETION, "echo": True}, "echo"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_field_is_a_400_naming_it(http: httpx.Client, case: str) -> None:
    path, body, param = BAD_BODIES[case]
    # Encoded here: httpx refuses to send a lone surrogate, which json.dumps escapes.
    raw = json.dumps(body).encode()
    error = assert_openai_error(
        http.post(path, content=raw, headers={"Content-Type": "application/json"}), 400
    )
    assert error["param"] == param


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'"a string"', b'{"prompt": "\xff\xfe"}', b"\xc3\x28"],
    ids=["malformed", "empty", "array", "string", "invalid utf-8 in string", "invalid utf-8"],
)
def test_unreadable_body_is_a_400(http: httpx.Client, raw: bytes) -> None:
    response = http.post(
        "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response, 400)


def test_oversized_body_is_a_413(http: httpx.Client) -> None:
    body = json.dumps({**COMPLETION, "prompt": "x" * (17 * 1024 * 1024)})
    response = http.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert assert_openai_error(response, 413)["code"] == "request_too_large"


def test_prompt_longer_than_max_model_len_names_both_numbers(http: httpx.Client) -> None:
    error = assert_openai_error(
        http.post("/v1/completions", json={**COMPLETION, "prompt": LONG_PROMPT}), 400
    )
    assert error["code"] == "context_length_exceeded"
    assert f"{MAX_MODEL_LEN:,}" in error["message"]
    num_prompt_tokens = len(LONG_PROMPT.split())
    assert any(
        f"{n:,}" in error["message"] for n in range(num_prompt_tokens - 5, num_prompt_tokens + 5)
    )
    chat = {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]}
    assert assert_openai_error(http.post("/v1/chat/completions", json=chat), 400)["code"] == (
        "context_length_exceeded"
    )


def test_unknown_model_is_a_404(http: httpx.Client) -> None:
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = assert_openai_error(http.post(path, json={**body, "model": "gpt-9"}), 404)
        assert error["code"] == "model_not_found"


def test_wrong_or_missing_api_key_is_a_401(server) -> None:
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            response = httpx.request(
                method, f"{server.url}{path}", json=COMPLETION, headers=headers
            )
            assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
    # Probes and scrapes need no key.
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200


async def test_a_thousand_concurrent_requests_against_max_queue(server) -> None:
    """Beyond --max-queue waiting requests the answer is 429 with Retry-After; the rest complete."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=server.url, headers=AUTH, timeout=600, limits=limits
    ) as client:
        responses = await asyncio.gather(
            *(
                client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
                for _ in range(1000)
            )
        )
    statuses = collections.Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 0 and statuses[200] >= MAX_QUEUE, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["Retry-After"].isdigit()
            assert assert_openai_error(response, 429)["code"] == "rate_limit_exceeded"
        else:
            assert response.json()["usage"]["completion_tokens"] == 1


def test_top_k_beyond_the_vocabulary_is_served_as_no_top_k(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={**COMPLETION, "top_k": 10**23})
    assert response.status_code == 200, response.text
    assert http.get("/health").status_code == 200


def test_logit_bias_forces_a_token(http: httpx.Client) -> None:
    body = {**COMPLETION, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    body["logit_bias"] = {"42": 100}
    tokens = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 3 and len(set(tokens)) == 1, tokens


def test_server_still_serves_and_leaked_no_kv_blocks(server, http: httpx.Client) -> None:
    metrics = server.wait_idle()
    assert metrics["llmpool:kv_cache_usage_perc"] == 0
    assert metrics["llmpool:num_requests_running"] == metrics["llmpool:num_requests_waiting"] == 0
    response = http.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
    assert "Traceback" not in server.log()
