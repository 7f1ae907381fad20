"""One output-token rule for the engine and the gateway, and the usage read from what is relayed.

The engine's side is what the engine's request parsing gives (``parse_completion_request`` and
``parse_chat_request``, which the engine server generates by); the gateway's is what it reserves
(``read_facts``). Every combination of the two fields on both routes must agree.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from llmpool.engine.server.responses_api import parse_responses_request
from llmpool.engine.server.responses_output import ResponseShape, usage
from llmpool.gateway.request import UNSAID_CHAT_MAX_TOKENS, read_facts
from llmpool.gateway.usage import BodyUsage, StreamUsage, Usage
from llmpool.protocol.errors import APIError
from llmpool.protocol.requests import parse_chat_request, parse_completion_request

ROUTES = {
    "/v1/completions": (parse_completion_request, {"prompt": "hi"}),
    "/v1/chat/completions": (parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]}),
}
VALUES = (None, 5, 9)  # each field: absent, or one of two limits


@pytest.mark.parametrize("path", ROUTES)
def test_the_engine_and_the_gateway_read_one_limit_for_every_combination(path: str) -> None:
    parse, fields = ROUTES[path]
    for max_tokens, max_completion_tokens in itertools.product(VALUES, VALUES):
        body: dict[str, Any] = {"model": "m", **fields}
        for name, value in (
            ("max_tokens", max_tokens),
            ("max_completion_tokens", max_completion_tokens),
        ):
            if value is not None:
                body[name] = value
        raw = json.dumps(body).encode()
        if None not in (max_tokens, max_completion_tokens) and max_tokens != max_completion_tokens:
            with pytest.raises(APIError) as engine_error:
                parse(body)
            with pytest.raises(APIError) as gateway_error:
                read_facts(raw, path, 64)
            assert engine_error.value.body() == gateway_error.value.body()
            own_alias = (
                "max_tokens" if path.endswith("/chat/completions") else "max_completion_tokens"
            )
            assert engine_error.value.param == own_alias
            continue
        parsed = parse(body)
        engine_limit = (
            parsed.max_tokens if parsed.max_tokens is not None else parsed.default_max_tokens
        )
        expected = max_tokens or max_completion_tokens
        if expected is None:  # neither: OpenAI's 16 on completions, until EOS on chat
            expected = 16 if path == "/v1/completions" else None
        assert engine_limit == expected, body
        reserved = read_facts(raw, path, 64).max_tokens
        assert reserved == (UNSAID_CHAT_MAX_TOKENS if engine_limit is None else engine_limit), body


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1, "7", True, 2.5])
def test_a_bad_limit_is_the_same_400_from_both(path: str, field: str, value: Any) -> None:
    parse, fields = ROUTES[path]
    body = {"model": "m", **fields, field: value}
    with pytest.raises(APIError) as engine_error:
        parse(body)
    with pytest.raises(APIError) as gateway_error:
        read_facts(json.dumps(body).encode(), path, 64)
    assert engine_error.value.status == 400 and engine_error.value.param == field
    assert engine_error.value.body() == gateway_error.value.body()


@pytest.mark.parametrize("max_output_tokens", [None, 5])
def test_a_responses_request_is_reserved_what_the_engine_generates(
    max_output_tokens: int | None,
) -> None:
    """The engine answers /v1/responses on the chat path, max_output_tokens as chat's limit."""
    body: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    _, chat = parse_responses_request(body, [])
    engine_limit = parse_chat_request(chat).max_tokens
    facts = read_facts(json.dumps(body).encode(), "/v1/responses", 64)
    assert engine_limit == max_output_tokens
    assert facts.max_tokens == (max_output_tokens or UNSAID_CHAT_MAX_TOKENS)
    assert not facts.forces_usage  # a Responses stream always ends with its usage


def test_a_responses_usage_is_read_from_its_stream_and_its_body() -> None:
    """The response object names the tokens input and output, in its last event of a stream;
    in a body its usage is the last field, after whatever the request echoes."""
    shape = ResponseShape("resp_1", "m", {"instructions": "x" * 10_000}, store=False)
    done = shape.response("done", [], usage(7, 3), finish_reason="stop")
    event = {"type": "response.completed", "sequence_number": 9, "response": done}
    stream = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
        + b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n"
    )  # fmt: skip
    reader = StreamUsage(forward=False)
    assert reader.feed(stream) + reader.flush() == stream  # nothing of a response is kept back
    assert reader.usage == Usage(7, 3)
    body = BodyUsage()
    body.feed(json.dumps(done).encode())
    assert body.usage == Usage(7, 3)


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
EVENTS = [
    b'data: {"choices":[{"index":0,"text":"a \\"usage\\": 1"}]}\n\n',
    b'data: {"choices":[{"index":0,"text":"b"}]}\n\n',
    b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n",
    b"data: [DONE]\n\n",
]


@pytest.mark.parametrize("forward", [True, False])
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_a_stream_s_usage_is_read_across_any_chunking_and_kept_from_a_client_who_did_not_ask(
    forward: bool, size: int
) -> None:
    stream = b"".join(EVENTS)
    reader = StreamUsage(forward)
    relayed = b"".join(reader.feed(stream[i : i + size]) for i in range(0, len(stream), size))
    relayed += reader.flush()
    assert reader.usage == Usage(7, 3)
    assert relayed == (stream if forward else b"".join(EVENTS[:2] + EVENTS[3:]))
    assert reader.events == 2  # what a stream cut before its usage is counted at least


def test_a_json_body_s_usage_is_read_from_its_tail() -> None:
    body = json.dumps(
        {"choices": [{"text": '"usage": {"prompt_tokens": 1}' * 500}], "usage": USAGE}
    )
    reader = BodyUsage()
    raw = body.encode()
    assert b"".join(reader.feed(raw[i : i + 333]) for i in range(0, len(raw), 333)) == raw
    assert reader.usage == Usage(7, 3)
    error = BodyUsage()
    error.feed(b'{"error": {"message": "no"}}')
    assert error.usage is None
