"""Property: whatever OpenAI-ish body a client sends, a real `llmpool serve` answers 200 or a 4xx in
OpenAI's error shape, stays healthy, and leaks no KV blocks.

Bodies are valid requests whose fields are, each with some probability, replaced by extreme,
wrong-typed or nested values (huge and negative numbers, NaN and infinities, unicode, lone
surrogates, token ids beyond the vocabulary, arrays nested around the nesting bound), with lists
sized around their bounds in ``limits`` (and the response size around --max-response-tokens),
and unknown fields up to and beyond their bound. The example budget is fixed and derandomized so a
CI run is reproducible; ``LLMPOOL_FUZZ_EXAMPLES`` raises it for a longer local hunt.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpool.protocol import limits

MODEL = "smollm2-135m-instruct"
VOCAB = 49152
SERVER_ARGS = [
    "--max-model-len", "64", "--max-num-seqs", "8", "--kv-cache-memory", "16MiB",
    "--max-queue", "64", "--no-access-log", "--max-response-tokens", "2000",
]  # fmt: skip
EXAMPLES = int(os.environ.get("LLMPOOL_FUZZ_EXAMPLES", "120"))

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 2**31, 2**63, 2**64, -(2**64), 10**30, -(10**30), 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["\ud800", "\U0001f600", "\x00", "NaN"])
)
JSON_ANY = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
NESTED = st.integers(1, 2 * limits.MAX_JSON_DEPTH).map(
    lambda depth: json.loads("[" * depth + "]" * depth)
)


def around(bound: int) -> st.SearchStrategy[int]:
    """List sizes just under, at and just over a bound."""
    return st.sampled_from([bound - 1, bound, bound + 1])


def tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)

VALID_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 200) | st.just(10**23),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "n": st.integers(1, 3) | around(limits.MAX_N),
    "min_tokens": st.integers(0, 3),
    "stop": st.lists(TEXT, max_size=2)
    | around(limits.MAX_STOP_STRINGS).map(lambda count: ["\n\n"] * count)
    | around(limits.MAX_STOP_CHARS).map(lambda length: "z" * length),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3)
    | around(limits.MAX_STOP_TOKEN_IDS).map(lambda count: list(range(VOCAB - count, VOCAB))),
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3
    )
    | around(limits.MAX_LOGIT_BIAS).map(lambda count: {str(i): -1.5 for i in range(count)}),
    "priority": st.sampled_from(["interactive", "batch", 0, 1, 7]),
    "cache_salt": st.text(max_size=8),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "tools": st.just(tools(1)) | around(limits.MAX_TOOLS).map(tools),
    "tool_choice": st.sampled_from(
        ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]
    ),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
        ]
    ),
    "structured_outputs": st.sampled_from(
        [{"choice": ["yes", "no"]}, {"regex": "[0-9]{1,3}"}, {"json_object": True}]
    ),
    "echo": st.booleans(),
}


# Fields no parser reads, which any body may carry within MAX_UNKNOWN_FIELDS_BYTES together.
UNKNOWN_FIELDS = {
    "user": st.text(max_size=8)
    | around(limits.MAX_UNKNOWN_FIELDS_BYTES - 2).map(lambda length: "u" * length),
    "metadata": NESTED | JSON_ANY,
}


def mangled(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the valid value; sometimes anything JSON can carry, or arrays nested deeply."""
    return st.one_of(valid, valid, JSON_ANY | NESTED)


COMPLETION_PROMPTS = (
    TEXT
    | TOKEN_IDS
    | st.lists(TEXT | TOKEN_IDS, min_size=1, max_size=2)
    | around(limits.MAX_PROMPTS).map(lambda count: ["Hi"] * count)
    | JSON_ANY
)
CONTENT_PARTS = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2
) | around(limits.MAX_CONTENT_PARTS).map(lambda count: [{"type": "text", "text": "a"}] * count)
MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool"]) | JSON_SCALARS,
                "content": TEXT | CONTENT_PARTS | JSON_ANY | NESTED,
            }
        ),
        min_size=1,
        max_size=3,
    )
    | around(limits.MAX_MESSAGES).map(lambda count: [{"role": "user", "content": "hi"}] * count)
    | JSON_ANY
)
OPTIONAL = {name: mangled(valid) for name, valid in VALID_FIELDS.items()} | UNKNOWN_FIELDS
COMPLETIONS = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": COMPLETION_PROMPTS,
        "max_tokens": mangled(st.integers(1, 6)),
    },
    optional={**OPTIONAL, "logprobs": mangled(st.integers(0, 5) | around(limits.MAX_LOGPROBS))},
)
CHATS = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": MESSAGES, "max_tokens": mangled(st.integers(1, 6))},
    optional={
        **OPTIONAL,
        "logprobs": mangled(st.booleans()),
        "top_logprobs": mangled(st.integers(0, 5) | around(limits.MAX_LOGPROBS)),
    },
)
REQUESTS = st.tuples(st.just("/v1/completions"), COMPLETIONS) | st.tuples(
    st.just("/v1/chat/completions"), CHATS
)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def assert_served_or_refused(response: httpx.Response, body: dict[str, Any]) -> None:
    status = response.status_code
    assert status == 200 or 400 <= status < 500, (status, response.text[:500])
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        return
    if body.get("stream") is True:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert not any('"error"' in event for event in events[:-1]), events
    else:
        assert response.json()["choices"], response.text[:500]


@settings(settings.get_profile("llmpool-server"), max_examples=EXAMPLES)
@given(request=REQUESTS)
def test_any_body_is_served_or_refused_and_the_server_lives(http: httpx.Client, request) -> None:
    path, body = request
    # Encoded here, NaN and lone surrogates included: httpx's json= would refuse some of these.
    raw = json.dumps(body, allow_nan=True).encode()
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_served_or_refused(response, body)
    assert http.get("/health").status_code == 200


def test_after_the_fuzzing_no_kv_block_is_held_and_requests_are_answered(server, http) -> None:
    metrics = server.wait_idle()
    assert metrics["llmpool:kv_cache_usage_perc"] == 0
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "the engine loop failed" not in server.log()
