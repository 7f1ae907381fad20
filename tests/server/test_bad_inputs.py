"""Whatever a client sends, it gets the right status and an OpenAI-shaped error; the server lives on."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from llmpool.protocol import limits

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_QUEUE = 128  # a request of limits.MAX_PROMPTS prompts fits
MAX_RESPONSE_TOKENS = 4096
SERVER_ARGS = [
    "--api-key", API_KEY, "--max-queue", str(MAX_QUEUE), "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "16", "--kv-cache-memory", "64MiB", "--no-access-log",
    "--max-response-tokens", str(MAX_RESPONSE_TOKENS),
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
    # Two names for one limit (llmpool.protocol.requests.output_limit): given both, they agree.
    "max_completion_tokens differs": (
        "/v1/completions", {**COMPLETION, "max_completion_tokens": 3}, "max_completion_tokens",
    ),
    "max_tokens differs on chat": (
        "/v1/chat/completions", {**CHAT, "max_completion_tokens": 3}, "max_tokens",
    ),
    "max_completion_tokens zero": (
        "/v1/completions", {**COMPLETION, "max_tokens": None, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
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
    "seed of the last choice beyond 64 bits": ("/v1/completions", {**COMPLETION, "n": 2, "seed": 2**64 - 1}, "seed"),
    "best_of": ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
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


def nested(depth: int) -> list:
    """Arrays nested ``depth`` levels deep."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def tool(name: str, parameters: object = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def call(index: int) -> dict:
    return {"id": f"c{index}", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def answered_calls(count: int) -> list[dict]:
    """An assistant turn of ``count`` calls and a tool message answering each (as it must)."""
    answers = [{"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(count)]
    return [{"role": "assistant", "tool_calls": [call(i) for i in range(count)]}, *answers]


# A token forced and made a stop token: each choice ends after one step, so a request at a bound
# is served at once however many tokens it could have had.
STOP_AT_ONCE = {"logit_bias": {"42": 100}, "stop_token_ids": [42]}
PARTS = [{"type": "text", "text": "a"}]
# The body's own object is one level, so a field may nest one level less than MAX_JSON_DEPTH.
DEEPEST_FIELD = limits.MAX_JSON_DEPTH - 1
UNKNOWN_BYTES = limits.MAX_UNKNOWN_FIELDS_BYTES - 2  # the string's quotes count
# Each bound, just over and at the limit: (path, body over, param named, body at the bound).
BOUNDS = {
    "n": ("/v1/completions", {**COMPLETION, "n": limits.MAX_N + 1}, "n", {**COMPLETION, **STOP_AT_ONCE, "n": limits.MAX_N}),
    "prompts": (
        "/v1/completions", {**COMPLETION, "prompt": ["Hi"] * (limits.MAX_PROMPTS + 1)}, "prompt",
        {**COMPLETION, **STOP_AT_ONCE, "prompt": ["Hi"] * limits.MAX_PROMPTS},
    ),
    "stop strings": (
        "/v1/completions", {**COMPLETION, "stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}, "stop",
        {**COMPLETION, "stop": [chr(65 + i) * limits.MAX_STOP_CHARS for i in range(limits.MAX_STOP_STRINGS)]},
    ),
    "stop string length": (
        "/v1/completions", {**COMPLETION, "stop": "x" * (limits.MAX_STOP_CHARS + 1)}, "stop",
        {**COMPLETION, "stop": "x" * limits.MAX_STOP_CHARS},
    ),
    "stop_token_ids": (
        "/v1/completions", {**COMPLETION, "stop_token_ids": list(range(limits.MAX_STOP_TOKEN_IDS + 1))},
        "stop_token_ids", {**COMPLETION, "min_tokens": 1, "stop_token_ids": list(range(limits.MAX_STOP_TOKEN_IDS))},
    ),
    "logit_bias": (
        "/v1/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}},
        "logit_bias", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS)}},
    ),
    "logprobs": (
        "/v1/completions", {**COMPLETION, "logprobs": limits.MAX_LOGPROBS + 1}, "logprobs",
        {**COMPLETION, "logprobs": limits.MAX_LOGPROBS},
    ),
    "top_logprobs": (
        "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": limits.MAX_LOGPROBS + 1},
        "top_logprobs", {**CHAT, "logprobs": True, "top_logprobs": limits.MAX_LOGPROBS},
    ),
    "messages": (
        "/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * (limits.MAX_MESSAGES + 1)},
        "messages", {**CHAT, "messages": CHAT["messages"] * limits.MAX_MESSAGES},
    ),
    "content parts": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": PARTS * (limits.MAX_CONTENT_PARTS + 1)}]},
        "messages[0].content",
        {**CHAT, "messages": [{"role": "user", "content": PARTS * limits.MAX_CONTENT_PARTS}]},
    ),
    "tool calls": (
        "/v1/chat/completions",
        {**CHAT, "messages": answered_calls(limits.MAX_TOOL_CALLS + 1)},
        "messages[0].tool_calls",
        {**CHAT, "messages": answered_calls(limits.MAX_TOOL_CALLS)},
    ),
    "tools": (
        "/v1/chat/completions", {**CHAT, "tools": [tool(f"f{i}") for i in range(limits.MAX_TOOLS + 1)]},
        "tools", {**CHAT, "tools": [tool(f"f{i}") for i in range(limits.MAX_TOOLS)], "tool_choice": "none"},
    ),
    "unknown fields": (
        "/v1/completions", {**COMPLETION, "user": "x" * (UNKNOWN_BYTES + 1)}, "user",
        {**COMPLETION, "user": "x" * UNKNOWN_BYTES},
    ),
    "nesting in an unknown field": (
        "/v1/completions", {**COMPLETION, "metadata": nested(DEEPEST_FIELD + 1)}, "metadata",
        {**COMPLETION, "metadata": nested(DEEPEST_FIELD)},
    ),
    # n x max_tokens x (1 + top logprobs) within --max-response-tokens; streamed: 16 times that.
    "response size": (
        "/v1/completions", {**COMPLETION, "n": 2, "max_tokens": 129, "logprobs": 15}, "max_tokens",
        {**COMPLETION, **STOP_AT_ONCE, "n": 2, "max_tokens": 128, "logprobs": 15},
    ),
    "streamed response size": (
        "/v1/completions", {**COMPLETION, "stream": True, "n": 17, "max_tokens": 250, "logprobs": 15},
        "max_tokens", {**COMPLETION, **STOP_AT_ONCE, "stream": True, "n": 16, "max_tokens": 250, "logprobs": 15},
    ),
    "chat response size, max tokens not set": (
        "/v1/chat/completions", {**CHAT, "max_tokens": None, "n": 2, "logprobs": True, "top_logprobs": 15},
        "max_completion_tokens", {**CHAT, **STOP_AT_ONCE, "max_tokens": None, "logprobs": True, "top_logprobs": 15},
    ),
    "sequences beyond the queue": (
        "/v1/completions", {**COMPLETION, "n": 2, "prompt": ["Hi"] * (MAX_QUEUE // 2 + 1)}, "n",
        {**COMPLETION, **STOP_AT_ONCE, "n": 2, "prompt": ["Hi"] * (MAX_QUEUE // 2)},
    ),
}  # fmt: skip
# Nesting beyond MAX_JSON_DEPTH, wherever it is, is a 400 naming the field it is in.
DEEP = nested(limits.MAX_JSON_DEPTH + 1)
NESTING = {
    "messages[].content": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": DEEP}]}, "messages"),
    "messages[] extra field": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": DEEP}]}, "messages"),
    "tools": ("/v1/chat/completions", {**CHAT, "tools": [tool("f", {"type": "object", "x": DEEP})]}, "tools"),
    "response_format.json_schema": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"x": DEEP}}}},
        "response_format",
    ),
    "logit_bias": ("/v1/completions", {**COMPLETION, "logit_bias": {"5": DEEP}}, "logit_bias"),
    "stop": ("/v1/completions", {**COMPLETION, "stop": DEEP}, "stop"),
    "prompt": ("/v1/completions", {**COMPLETION, "prompt": DEEP}, "prompt"),
    "unknown field": ("/v1/completions", {**COMPLETION, "vllm_xargs": {"a": DEEP}}, "vllm_xargs"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BOUNDS))
def test_each_bound_refuses_just_over_and_serves_at_it(http: httpx.Client, case: str) -> None:
    path, over, param, at = BOUNDS[case]
    error = assert_openai_error(http.post(path, json=over), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "at most" in error["message"] or "between" in error["message"], error
    response = http.post(path, json=at)
    if response.status_code != 200:  # served, or refused only because the prompt is too long
        assert assert_openai_error(response, 400)["code"] == "context_length_exceeded"
    elif at.get("stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("case", list(NESTING))
def test_deep_nesting_in_any_field_is_a_400_naming_it(http: httpx.Client, case: str) -> None:
    path, body, param = NESTING[case]
    error = assert_openai_error(http.post(path, json=body), 400)
    assert (
        error["param"] == param and f"at most {limits.MAX_JSON_DEPTH} levels" in error["message"]
    ), error
    assert http.get("/health").status_code == 200


def test_call_arguments_nested_past_the_recursion_limit_are_not_a_500(http: httpx.Client) -> None:
    deep = "[" * 5000 + "]" * 5000  # a string field: not nesting in the body, JSON when parsed
    arguments = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    answer = {"role": "tool", "tool_call_id": "c", "content": "ok"}
    body = {**CHAT, "messages": [{"role": "assistant", "tool_calls": [arguments]}, answer]}
    response = http.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        assert assert_openai_error(response, 400)["code"] == "context_length_exceeded"


# 12 MB each: tokenizing one whole would take the CPU for seconds; spaces are ~64 to a token.
@pytest.mark.parametrize(
    "prompt", ["hello " * 2_000_000, " " * 12_000_000], ids=["words", "spaces"]
)
def test_a_huge_prompt_is_refused_from_its_start_alone(http: httpx.Client, prompt: str) -> None:
    response = http.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
    error = assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded" and f"{len(prompt):,}" in error["message"]


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


def test_adapter_routes_without_lora_are_a_400(http: httpx.Client) -> None:
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        body = {"lora_name": "a", "lora_path": "/tmp/a"}
        assert assert_openai_error(http.post(path, json=body), 400)["code"] == "lora_not_enabled"


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
