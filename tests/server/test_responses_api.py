"""The Responses API (``/v1/responses``) of a real `llmpool serve`, driven by the official openai
client: answers are checked against the chat route's for the same greedy request (the Responses
route is served on the chat path, so they must be equal), calls and parsed outputs against their
schemas, streams against OpenAI's event order, and stored responses across two turns and keys."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from llmpool.protocol import limits

MODEL = "smollm2-135m-instruct"
SERVER_ARGS = [
    "--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB",
    "--no-access-log", "--response-store-max-count", "64",
]  # fmt: skip
EXAMPLES = int(os.environ.get("LLMPOOL_FUZZ_EXAMPLES", "60"))
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def other_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-b", max_retries=0, timeout=300)


def chat_text(client: openai.OpenAI, messages: list[Any], max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=max_tokens, temperature=0, **extra
    )


def test_text_equals_the_chat_route_for_the_same_greedy_request(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="Name a colour.",
        max_output_tokens=12, temperature=0, reasoning={"effort": "low"},
    )  # fmt: skip
    chat = chat_text(
        client,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ],
        12,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected and response.model == MODEL
    assert response.output[0].type == "message" and response.output[0].role == "assistant"


def test_a_tool_round_trip_through_function_call_output(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=QUESTION, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    final = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": QUESTION}, *first.output, result],
        tools=[WEATHER], tool_choice="none", max_output_tokens=24, temperature=0,
    )  # fmt: skip
    assert all(item.type == "message" for item in final.output) and final.output_text.strip()
    # The same conversation on the chat route answers the same: the call and its result reached
    # the prompt as chat writes them.
    chat = chat_text(
        client,
        [
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": calls[0].call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": calls[0].arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"},
        ],
        24,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none",
    )
    assert final.output_text == chat.choices[0].message.content


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0)


def test_parse_validates_a_json_schema_answer(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL, input="Give me a city and its population.", text_format=City,
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, City)
    anything = client.responses.create(
        model=MODEL, input="Give me a JSON object.", text={"format": {"type": "json_object"}},
        max_output_tokens=40, temperature=0,
    )  # fmt: skip
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def _without_deltas(events: list[Any]) -> list[str]:
    return [e.type for e in events if not e.type.endswith(".delta")]


def test_streamed_text_events_in_order_equal_the_answer(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert _without_deltas(events) == [
        "response.created", "response.in_progress", *TEXT_EVENTS, last,
    ]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response() if whole.status == "completed" else None
    if final is not None:
        assert final.output_text == whole.output_text


def test_streamed_function_call_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True,
        )
    )  # fmt: skip
    assert _without_deltas(events) == [
        "response.created", "response.in_progress", *CALL_EVENTS, "response.completed",
    ]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = events[-1].response.output
    assert call.type == "function_call" and deltas == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_stored_responses_continue_and_are_scoped_to_their_key(
    client: openai.OpenAI, other_client: openai.OpenAI
) -> None:
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    chat = chat_text(
        client,
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        8,
    )
    assert second.output_text == chat.choices[0].message.content
    for forbidden in (
        lambda: other_client.responses.retrieve(first.id),
        lambda: other_client.responses.delete(first.id),
        lambda: other_client.responses.create(
            model=MODEL, input="Hi", previous_response_id=first.id, max_output_tokens=1
        ),
    ):
        with pytest.raises(openai.NotFoundError) as foreign:
            forbidden()
        assert first.id in foreign.value.message
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert first.id in gone.value.message
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "function_call_output"}]},
            "input[1].call_id",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_nothing"}, "previous_response_id"),
        ({"tools": [WEATHER] * (limits.MAX_TOOLS + 1)}, "tools"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, fields: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields}
    answer = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert 400 <= answer.status_code < 500, answer.text
    assert answer.json()["error"]["param"] == param


# --- fuzz ---------------------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8"), max_size=20) | st.sampled_from(["\ud800", ""])
JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT}
)
CALL_ID = st.sampled_from(["call_1", "call_2", ""]) | JSON_ANY
ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
            "content": TEXT | st.lists(PART, max_size=3),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": CALL_ID, "name": TEXT, "arguments": TEXT}
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": CALL_ID, "output": TEXT}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"])}),
    JSON_ANY,
)
TOOL = st.one_of(
    st.just(WEATHER),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "web_search"]),
            "name": st.sampled_from(["f", "get_weather", "bad name"]) | TEXT,
        },
        optional={"parameters": JSON_ANY | st.just(WEATHER_PARAMETERS), "strict": JSON_ANY},
    ),
)
BODY = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "input": TEXT | st.lists(ITEM, min_size=0, max_size=4) | JSON_ANY,
        "max_output_tokens": st.integers(-1, 8),
    },
    optional={
        "tools": st.lists(TOOL, max_size=3) | JSON_ANY,
        "tool_choice": st.sampled_from(
            [
                "auto",
                "none",
                "required",
                {"type": "function", "name": "get_weather"},
                {"type": "function", "name": "absent"},
            ]
        )
        | JSON_ANY,  # fmt: skip
        "instructions": TEXT | JSON_ANY,
        "text": st.fixed_dictionaries(
            {"format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]) | JSON_ANY}
        ),
        "stream": st.booleans(),
        "store": st.booleans() | JSON_ANY,
        "include": st.lists(st.sampled_from(["reasoning.encrypted_content", "x"]), max_size=2),
        "temperature": st.floats(0, 2) | JSON_ANY,
        "metadata": st.dictionaries(TEXT, TEXT, max_size=3) | JSON_ANY,
    },
)


@settings(settings.get_profile("llmpool-server"), max_examples=EXAMPLES)
@given(body=BODY)
def test_fuzzed_input_items_and_tools_answer_valid_or_4xx(server, body: dict[str, Any]) -> None:
    answer = httpx.post(f"{server.url}/v1/responses", content=json.dumps(body), timeout=120)
    if answer.status_code == 200:
        if body.get("stream"):
            assert answer.text.rstrip().split("\n")[0].startswith("event: response.created")
            final = json.loads(answer.text.rstrip().rsplit("data: ", 1)[1])
            assert final["type"] in ("response.completed", "response.incomplete")
        else:
            assert answer.json()["object"] == "response"
    else:
        assert 400 <= answer.status_code < 500, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_no_kv_blocks_held_after_the_fuzz(server) -> None:
    metrics = server.wait_idle()
    assert metrics["llmpool:kv_cache_usage_perc"] == 0
    assert metrics["llmpool:num_requests_running"] == 0
