"""Tool calls on strings: each parser of model output, the stream that holds calls back, the forced
schemas (checked with jsonschema), and tools rendered into SmolLM2's prompt (no server)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmpool.engine.server.prompts import PromptBuilder
from llmpool.engine.server.tool_calls import (
    Function,
    ToolCallShaper,
    ToolChoice,
    detect_parser,
    forced_schema,
    hermes_messages,
    parse_tool_calls,
)

WEATHER = Function(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
    "The weather in a city",
)
SEARCH = Function(
    "search",
    {
        "type": "object",
        "properties": {"query": {"$ref": "#/$defs/Query"}},
        "required": ["query"],
        "$defs": {"Query": {"type": "string", "maxLength": 10}},
    },
)
# A second tool whose $defs share a name with SEARCH's but mean something else.
COUNT = Function(
    "count",
    {
        "type": "object",
        "properties": {"query": {"$ref": "#/$defs/Query"}},
        "required": ["query"],
        "$defs": {"Query": {"type": "integer"}},
    },
)


def calls_of(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PARSER_CASES = {
    "hermes one call after text": (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
        ' "unit": "c"}}\n</tool_call>',
        ("Let me check.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ),
    "hermes two calls": (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        (None, [("a", {"x": 1}), ("b", {})]),
    ),
    "hermes arguments as JSON text": (
        "hermes",
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>',
        (None, [("a", {"x": 1})]),
    ),
    "hermes cut off is content": (
        "hermes",
        '<tool_call>{"name": "a", "argum',
        ('<tool_call>{"name": "a", "argum', []),
    ),
    "hermes no call": ("hermes", "Just text.", ("Just text.", [])),
    "llama3 python tag, two calls, end token": (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters":'
        " {}}<|eom_id|>",
        (None, [("a", {"s": "x;y"}), ("b", {})]),
    ),
    "llama3 bare JSON": (
        "llama3_json",
        ' {"name": "a", "parameters": {"n": 2}}',
        (None, [("a", {"n": 2})]),
    ),
    "llama3 text": ("llama3_json", "The answer is 4.", ("The answer is 4.", [])),
    "llama3 JSON that is no call": ("llama3_json", '{"x": 1}', ('{"x": 1}', [])),
    "mistral marker": (
        "mistral",
        'Sure [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments":'
        " {}}]</s>",
        ("Sure", [("a", {"x": 1}), ("b", {})]),
    ),
    "mistral marker skipped as a special token": (
        "mistral",
        '[{"name": "a", "arguments": {"x": 1}}]',
        (None, [("a", {"x": 1})]),
    ),
    "mistral text": ("mistral", "No tools needed.", ("No tools needed.", [])),
}


@pytest.mark.parametrize("case", list(PARSER_CASES))
def test_each_parser_reads_calls_and_content(case: str) -> None:
    parser, text, expected = PARSER_CASES[case]
    assert calls_of(parser, text) == expected


@pytest.mark.parametrize("case", list(PARSER_CASES))
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_stream_sends_what_the_whole_answer_says(case: str, piece: int) -> None:
    """Content streams out before any call; calls come whole at the end, ids and all."""
    parser, text, (content, calls) = PARSER_CASES[case]
    stream = ToolCallShaper(ToolChoice("auto"), parser).stream()
    deltas = []
    for start in range(0, len(text), piece):
        deltas += stream.feed(text[start : start + piece])
    last, finish_reason = stream.finish("stop")
    deltas += last
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed.strip() == (content or ""), deltas  # whitespace before a call may go out
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [
        (d["function"]["name"], json.loads(d["function"]["arguments"])) for d in tool_deltas
    ] == calls
    assert [d["index"] for d in tool_deltas] == list(range(len(calls)))
    assert all(d["id"].startswith("call_") and d["type"] == "function" for d in tool_deltas)
    assert finish_reason == ("tool_calls" if calls else "stop")


def test_a_named_call_streams_its_arguments_as_they_grow() -> None:
    stream = ToolCallShaper(ToolChoice("named", "get_weather"), "hermes").stream()
    pieces = ['{"city"', ': "Oslo", ', '"unit": "c"}']
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    last, finish_reason = stream.finish("stop")
    assert last == [] and finish_reason == "tool_calls"
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(arguments) == {"city": "Oslo", "unit": "c"}
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])


CUT_OFF_REQUIRED = {
    "inside the second call's arguments": (
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [1, ',
        [("a", '{"x": 1}'), ("b", '{"y": [1, ')],
    ),
    "before the second call's arguments": (
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "param',
        [("a", '{"x": 1}'), ("b", "")],
    ),
    "inside the first call's name": ('[{"name": "get_wea', []),
    "at the opening bracket": ("[", []),
}


@pytest.mark.parametrize("case", list(CUT_OFF_REQUIRED))
def test_a_cut_off_required_answer_returns_its_partial_calls_not_content(case: str) -> None:
    """As a named call cut off by max_tokens returns its arguments so far: the finished calls,
    and the unfinished one once its name is whole, streamed or not; never the array as text."""
    text, expected = CUT_OFF_REQUIRED[case]
    shaper = ToolCallShaper(ToolChoice("required"), "hermes")
    message, finish_reason = shaper.message(text, "length")
    assert finish_reason == "length" and message["content"] is None
    calls = message.get("tool_calls", [])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    stream = shaper.stream()
    deltas = [d for piece in text for d in stream.feed(piece)]
    last, finish_reason = stream.finish("length")
    deltas += last
    assert finish_reason == "length" and not any("content" in d for d in deltas)
    streamed = [d["tool_calls"][0] for d in deltas]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == expected
    assert [c["index"] for c in streamed] == list(range(len(expected)))


def test_the_named_schema_is_the_functions_parameters() -> None:
    assert forced_schema([WEATHER, SEARCH], ToolChoice("named", "search"), True) is (
        SEARCH.parameters
    )
    assert forced_schema([WEATHER], ToolChoice("auto"), True) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_the_required_schema_takes_calls_of_the_tools_and_nothing_else(parallel: bool) -> None:
    """Each tool's $defs stay its own, even when two tools use the same $defs name."""
    schema = forced_schema([WEATHER, SEARCH, COUNT], ToolChoice("required"), parallel)
    validator = jsonschema.Draft202012Validator(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}},
        {"name": "search", "parameters": {"query": "short"}},
        {"name": "count", "parameters": {"query": 3}},
    ]
    for call in good:
        assert validator.is_valid([call]), call
    assert validator.is_valid(good) is parallel
    bad = [
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "search", "parameters": {"query": 3}}],
        [{"name": "count", "parameters": {"query": "three"}}],
        [{"name": "search", "parameters": {"query": "far too long a query"}}],
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "k"}}],
        [{"name": "get_weather"}],
    ]
    for calls in bad:
        assert not validator.is_valid(calls), calls


def test_the_parser_comes_from_the_template() -> None:
    assert detect_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert detect_parser("<|start_header_id|>{{ tools }}<|python_tag|>") == "llama3_json"
    assert detect_parser(None) == "hermes"


@pytest.fixture(scope="module")
def tokenizer(builtin_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_folder)


CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "content": '{"temperature": -3}', "tool_call_id": "call_1"},
]


def test_smollm2s_template_gets_tools_calls_and_results_written_hermes_style(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, None, 2048)
    assert not builder.template_knows_tools
    text = tokenizer.decode(builder.chat_ids(CONVERSATION, True, [WEATHER]))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    tools = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools) == WEATHER.to_openai()
    call = text.split("<|im_start|>assistant\n<tool_call>\n")[1].split("\n</tool_call>")[0]
    assert json.loads(call) == {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    assert '<|im_start|>user\n<tool_response>\n{"temperature": -3}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_system_message_keeps_its_text_before_the_tools(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, None, 2048)
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    text = tokenizer.decode(builder.chat_ids(messages, True, [WEATHER]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.count("<|im_start|>system") == 1


def test_a_template_that_renders_tools_gets_them_and_arguments_as_objects(tokenizer) -> None:
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }}{% endfor %}"
        "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    builder = PromptBuilder(tokenizer, template, 2048)
    assert builder.template_knows_tools
    text = tokenizer.decode(builder.chat_ids(CONVERSATION, False, [WEATHER]))
    assert text == (
        'TOOL get_weather;user:Weather in Oslo?;assistant:CALL Oslo;tool:{"temperature": -3}'
        " for call_1;"
    )


def test_results_of_parallel_calls_become_one_user_message() -> None:
    results = [
        {"role": "tool", "content": "1", "tool_call_id": "call_a"},
        {"role": "tool", "content": "2", "tool_call_id": "call_b"},
    ]
    rendered = hermes_messages([*CONVERSATION[:2], *results, CONVERSATION[0]], [])
    assert [m["role"] for m in rendered] == ["user", "assistant", "user", "user"]
    assert rendered[2]["content"] == (
        "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    )
