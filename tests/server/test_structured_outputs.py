"""Structured outputs and tool calling through a real `llmpool serve` and the official openai client.

Every answer is checked against the schema it was asked for with jsonschema, never against a
recorded text: constrained answers must validate whatever the model writes. One server serves
the whole module, the property test included.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import re
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"
SERVER_ARGS = [
    "--max-model-len", "1024", "--max-num-seqs", "24", "--kv-cache-memory", "96MiB",
    "--no-access-log",
]  # fmt: skip
MAX_TOKENS = 160  # every schema below bounds its strings and arrays, so answers end before this
EXAMPLES = int(os.environ.get("LLMPOOL_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# --- 20 Pydantic models, parsed by client.chat.completions.parse --------------------------------

ShortText = Annotated[str, Field(max_length=16)]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Priority(enum.Enum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class City(BaseModel):
    name: ShortText
    country: ShortText
    population: int = Field(ge=0, le=50_000_000)


class PersonContact(BaseModel):
    name: ShortText
    age: int = Field(ge=0, le=120)
    email: str | None = Field(max_length=24)


class Paint(BaseModel):
    color: Color
    hex_code: str = Field(pattern=r"^#[0-9a-f]{6}$")


class Point(BaseModel):
    x: float = Field(ge=-100, le=100)
    y: float = Field(ge=-100, le=100)


class Book(BaseModel):
    title: ShortText
    authors: list[ShortText] = Field(max_length=2)
    year: int = Field(ge=1400, le=2030)


class Address(BaseModel):
    street: ShortText
    city: ShortText
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Item(BaseModel):
    name: ShortText
    quantity: int = Field(ge=1, le=10)
    price: float = Field(ge=0, le=1000)


class Order(BaseModel):
    order_id: int = Field(ge=1, le=99999)
    items: list[Item] = Field(min_length=1, max_length=2)


class Weather(BaseModel):
    city: ShortText
    temperature: float = Field(ge=-50, le=60)
    condition: Literal["sunny", "rainy", "cloudy", "snowy"]


class Movie(BaseModel):
    title: ShortText
    rating: float = Field(ge=0, le=10)
    genres: list[Literal["drama", "comedy", "action", "horror"]] = Field(max_length=2)


class Ingredient(BaseModel):
    name: ShortText
    grams: int = Field(ge=1, le=1000)


class Recipe(BaseModel):
    name: ShortText
    ingredients: list[Ingredient] = Field(max_length=2)
    vegetarian: bool


class Task(BaseModel):
    title: ShortText
    priority: Priority
    done: bool
    due: str | None = Field(pattern=r"^2026-[0-9]{2}-[0-9]{2}$")


class Employee(BaseModel):
    name: ShortText
    age: int = Field(ge=18, le=99)


class Company(BaseModel):
    name: ShortText
    employees: int = Field(ge=1, le=1_000_000)
    ceo: Employee


class Reading(BaseModel):
    unit: Literal["C", "F"]
    value: float = Field(ge=-100, le=200)


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    price: float = Field(ge=0, le=10000)
    in_stock: bool
    tags: list[ShortText] = Field(max_length=2)


class Event(BaseModel):
    name: ShortText
    day: int = Field(ge=1, le=31)
    month: int = Field(ge=1, le=12)
    guests: list[ShortText] = Field(max_length=2)


class Grades(BaseModel):
    student: ShortText
    scores: list[int] = Field(max_length=3)
    passed: bool


class Vector(BaseModel):
    x: int = Field(ge=-10, le=10)
    y: int = Field(ge=-10, le=10)
    z: int = Field(ge=-10, le=10)


class Animal(BaseModel):
    species: Literal["cat", "dog", "bird", "fish"]
    legs: int = Field(ge=0, le=8)
    can_fly: bool
    sound: str | None = Field(max_length=10)


class InvoiceLine(BaseModel):
    amount: float = Field(ge=0, le=500)
    product: ShortText


class Invoice(BaseModel):
    customer: Employee
    lines: list[InvoiceLine] = Field(max_length=2)
    currency: Literal["USD", "EUR"]
    paid: bool | None


PARSE_CASES: list[tuple[type[BaseModel], str]] = [
    (City, "Describe Paris."),
    (PersonContact, "Invent a person with a name, age and email."),
    (Paint, "Pick a paint color."),
    (Point, "Give a point on a plane."),
    (Book, "Describe a famous novel."),
    (Address, "Write an address in Berlin."),
    (Order, "Write an order of two fruits."),
    (Weather, "What is the weather in London today?"),
    (Movie, "Describe a movie you like."),
    (Recipe, "Give a short pancake recipe."),
    (Task, "Create a to-do item for buying milk."),
    (Company, "Describe a small company."),
    (Reading, "Report a thermometer reading."),
    (Product, "Describe a product in a shop."),
    (Event, "Plan a birthday party."),
    (Grades, "Report a student's grades."),
    (Vector, "Give a vector in 3D."),
    (Animal, "Describe a dog."),
    (Invoice, "Write an invoice."),
    (Employee, "Describe an employee."),
]


def sent_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The schema the openai client sends for ``model`` (strict: every field required)."""
    return type_to_response_format_param(model)["json_schema"]["schema"]  # type: ignore[index]


async def test_parse_returns_a_validated_object_for_20_schemas(
    async_client: openai.AsyncOpenAI,
) -> None:
    assert len({model for model, _ in PARSE_CASES}) == 20

    async def parse(model: type[BaseModel], prompt: str) -> Any:
        return await async_client.chat.completions.parse(
            model=MODEL, messages=user(f"{prompt} Answer in JSON."), response_format=model,
            max_tokens=MAX_TOKENS, temperature=0,
        )  # fmt: skip

    answers = await asyncio.gather(*(parse(model, prompt) for model, prompt in PARSE_CASES))
    for (model, _), answer in zip(PARSE_CASES, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), model.__name__
        jsonschema.validate(json.loads(choice.message.content), sent_schema(model))


def test_json_object_and_n_choices_each_answer_json(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=user("Give me a JSON object about cats."), n=2, temperature=1,
        seed=7, max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
    )  # fmt: skip
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut off: still the start of an object
            assert choice.message.content.lstrip().startswith("{")


def test_a_streamed_json_schema_answer_validates(client: openai.OpenAI) -> None:
    schema = sent_schema(Weather)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=user("Weather in Rome as JSON."), max_tokens=MAX_TOKENS,
            temperature=0, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


STRUCTURED_CASES = {
    "regex": ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    "choice": ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    "grammar": (
        {"grammar": 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'},
        lambda t: t in ("The answer is yes.", "The answer is no."),
    ),
    "json": (
        # Closed, as every schema here is bounded: an open object let greedy decoding add
        # properties until max_tokens, on kernels whose rounding tipped it there.
        {
            "json": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            }
        },
        lambda t: isinstance(json.loads(t)["n"], int),
    ),
    "json as text": (
        {"json": json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 3})},
        lambda t: (
            jsonschema.validate(json.loads(t), {"type": "array", "items": {"type": "boolean"}})
            is None
        ),
    ),
}


@pytest.mark.parametrize("case", list(STRUCTURED_CASES))
def test_vllms_structured_outputs_on_completions_and_chat(client: openai.OpenAI, case: str) -> None:
    spec, valid = STRUCTURED_CASES[case]
    completion = client.completions.create(
        model=MODEL, prompt="Answer: ", max_tokens=60, temperature=0,
        extra_body={"structured_outputs": spec},
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=user("Answer the question."), max_tokens=60, temperature=0,
        extra_body={"structured_outputs": spec},
    )  # fmt: skip
    for finish_reason, text in (
        (completion.choices[0].finish_reason, completion.choices[0].text),
        (chat.choices[0].finish_reason, chat.choices[0].message.content),
    ):
        assert finish_reason == "stop", text
        assert valid(text), text


# --- tools ------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [
    WEATHER_TOOL,
    openai.pydantic_function_tool(Order, name="place_order", description="Place an order"),
    openai.pydantic_function_tool(Invoice, name="send_invoice", description="Send an invoice"),
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = user("What is the weather in Paris? Use the tools.")


def assert_valid_calls(calls: list[Any]) -> None:
    """Each call names an offered tool, has an id, and its arguments validate."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed_calls(chunks: list[Any]) -> tuple[list[Any], str | None]:
    """The calls a stream's tool-call deltas add up to (OpenAI's rule: merge by index)."""
    calls: dict[int, dict[str, str]] = {}
    finish_reason = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    merged = [
        openai.types.chat.ChatCompletionMessageToolCall.model_validate(
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
        )  # fmt: skip
        for _, c in sorted(calls.items())
    ]
    return merged, finish_reason


NAMED = {"type": "function", "function": {"name": "send_invoice"}}


@pytest.mark.parametrize(
    "tool_choice, parallel",
    [(NAMED, True), ("required", False), ("required", True)],
    ids=["named", "required one", "required parallel"],
)
def test_forced_calls_validate_against_their_functions(
    client: openai.OpenAI, tool_choice: Any, parallel: bool
) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    calls = choice.message.tool_calls
    assert_valid_calls(calls)
    if tool_choice == NAMED:
        assert [c.function.name for c in calls] == ["send_invoice"]
    if not parallel:
        assert len(calls) == 1
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None
    else:  # parallel calls may go on until max_tokens; the finished ones are kept
        assert parallel and choice.finish_reason == "length"


@pytest.mark.parametrize(
    "tool_choice, parallel",
    [(NAMED, True), ("required", False)],
    ids=["named", "required one"],
)
def test_streamed_forced_calls_validate_against_their_functions(
    client: openai.OpenAI, tool_choice: Any, parallel: bool
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        )
    )  # fmt: skip
    calls, finish_reason = streamed_calls(chunks)
    assert finish_reason == "tool_calls"
    assert_valid_calls(calls)
    assert len(calls) == 1
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)


def test_auto_answers_content_or_calls_that_name_offered_tools(client: openai.OpenAI) -> None:
    """SmolLM2 was not trained on tools, so auto may answer either way; both must be well-formed."""
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=60, temperature=0
    )
    choice = answer.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        assert {c.function.name for c in choice.message.tool_calls} <= set(PARAMETERS)
    else:
        assert isinstance(choice.message.content, str) and choice.message.content


def test_a_tool_round_trip_ends_in_an_answer(client: openai.OpenAI) -> None:
    messages: list[Any] = list(QUESTION)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    assert_valid_calls([call])
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}
    )
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40,
        temperature=0,
    )  # fmt: skip
    choice = final.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    # The result reached the prompt: the same conversation with an empty result is shorter (a
    # call must be answered, so the result cannot be left out).
    empty = {"role": "tool", "tool_call_id": call.id, "content": ""}
    without = client.chat.completions.create(
        model=MODEL, messages=[*messages[:-1], empty], tool_choice="none", tools=TOOLS, max_tokens=1
    )
    assert final.usage.prompt_tokens > without.usage.prompt_tokens


# --- bounds and bad inputs: each a 400 naming the field -----------------------------------------

CHAT = {"model": MODEL, "messages": user("Hi"), "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


HUGE_SCHEMA = {"enum": ["x" * 100 + str(i) for i in range(700)]}  # ~72 KiB as JSON
BAD_BODIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "too many tools": ("chat", {"tools": [tool(f"f{i}") for i in range(129)]}, "tools"),
    "tool name with spaces": ("chat", {"tools": [tool("get weather")]}, "tools"),
    "tool name too long": ("chat", {"tools": [tool("f" * 65)]}, "tools"),
    "tool names twice": ("chat", {"tools": [tool("f"), tool("f")]}, "tools"),
    "tool not a function": ("chat", {"tools": [{"type": "retrieval"}]}, "tools"),
    "tool parameters too deep": ("chat", {"tools": [tool("f", nested(40))]}, "tools"),
    "tool parameters too big": ("chat", {"tools": [tool("f", HUGE_SCHEMA)]}, "tools"),
    "tool parameters do not compile": (
        "chat",
        {
            "tools": [tool("f", {"type": "integer", "minimum": 5, "maximum": 1})],
            "tool_choice": "required",
        },
        "tools",
    ),  # fmt: skip
    "tool_choice names a missing tool": (
        "chat",
        {"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),  # fmt: skip
    "tool_choice required without tools": ("chat", {"tool_choice": "required"}, "tool_choice"),
    "tool_choice unknown": ("chat", {"tools": [tool("f")], "tool_choice": "always"}, "tool_choice"),
    "parallel_tool_calls not a boolean": (
        "chat",
        {"tools": [tool("f")], "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
    ),  # fmt: skip
    "tools on completions": ("completion", {"tools": [tool("f")]}, "tools"),
    "legacy functions": ("chat", {"functions": [{"name": "f"}]}, "functions"),
    "legacy function_call": ("chat", {"function_call": "auto"}, "function_call"),
    "schema too deep": ("chat", {"response_format": json_schema(nested(40))}, "response_format"),
    "schema too big": ("chat", {"response_format": json_schema(HUGE_SCHEMA)}, "response_format"),
    "schema does not compile": (
        "chat",
        {"response_format": json_schema({"$ref": "#/$defs/missing"})},
        "response_format",
    ),  # fmt: skip
    "schema with NaN": (
        "chat",
        {"response_format": json_schema({"maximum": float("nan")})},
        "response_format",
    ),  # fmt: skip
    "schema with a lone surrogate": (
        "chat",
        {"response_format": json_schema({"enum": ["\ud800"]})},
        "response_format",
    ),  # fmt: skip
    "schema with an integer beyond 64 bits": (
        "chat",
        {"response_format": json_schema({"type": "integer", "maximum": 10**30})},
        "response_format",
    ),  # fmt: skip
    "schema not an object": ("chat", {"response_format": json_schema([1])}, "response_format"),
    "schema name invalid": (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format",
    ),
    "response_format type unknown": (
        "chat",
        {"response_format": {"type": "xml"}},
        "response_format",
    ),
    "choice too many": (
        "completion",
        {"structured_outputs": {"choice": [str(i) for i in range(1025)]}},
        "structured_outputs",
    ),  # fmt: skip
    "choice too long": (
        "completion",
        {"structured_outputs": {"choice": ["x" * 5000]}},
        "structured_outputs",
    ),  # fmt: skip
    "choice empty": ("completion", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    "regex too long": (
        "completion",
        {"structured_outputs": {"regex": "a" * 9000}},
        "structured_outputs",
    ),  # fmt: skip
    "regex does not compile": (
        "chat",
        {"structured_outputs": {"regex": "(a"}},
        "structured_outputs",
    ),
    "grammar too long": (
        "completion",
        {"structured_outputs": {"grammar": "start: " + " | ".join(['"x"'] * 20000)}},
        "structured_outputs",
    ),
    "grammar does not compile": (
        "chat",
        {"structured_outputs": {"grammar": "start: nowhere"}},
        "structured_outputs",
    ),  # fmt: skip
    "structured_outputs json too deep": (
        "chat",
        {"structured_outputs": {"json": nested(40)}},
        "structured_outputs",
    ),  # fmt: skip
    "structured_outputs json text invalid": (
        "chat",
        {"structured_outputs": {"json": "{not json"}},
        "structured_outputs",
    ),  # fmt: skip
    "structured_outputs two kinds": (
        "chat",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
    ),  # fmt: skip
    "structured_outputs unknown key": (
        "chat",
        {"structured_outputs": {"whitespace_pattern": " "}},
        "structured_outputs",
    ),  # fmt: skip
    "response_format and structured_outputs": (
        "chat",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    "response_format and a named tool": (
        "chat",
        {
            "response_format": {"type": "json_object"},
            "tools": [tool("f")],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tool_choice",
    ),  # fmt: skip
    "structured_outputs and required": (
        "chat",
        {"structured_outputs": {"regex": "a"}, "tools": [tool("f")], "tool_choice": "required"},
        "tool_choice",
    ),  # fmt: skip
    "tool message without its call id": (
        "chat",
        {"messages": [*user("Hi"), {"role": "tool", "content": "42"}]},
        "messages[1].tool_call_id",
    ),
    "assistant tool_calls malformed": (
        "chat",
        {
            "messages": [
                *user("Hi"),
                {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
            ]
        },
        "messages[1].tool_calls",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_each_bound_and_bad_field_is_a_400_naming_it(http: httpx.Client, case: str) -> None:
    kind, fields, param = BAD_BODIES[case]
    path, base = (
        ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", COMPLETION)
    )
    raw = json.dumps({**base, **fields}).encode()  # NaN and lone surrogates as JSON writes them
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_deeply_nested_request_json_is_a_400(http: httpx.Client) -> None:
    raw = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = http.post(
        "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert "deeply" in response.json()["error"]["message"]


# --- property: generated schemas and tool lists ----------------------------------------------

# Each generated schema carries whether it must be served ("valid": plain, within the bounds),
# must be refused ("invalid"), or may go either way ("either": huge enums, over the size bound
# only sometimes, what the grammar library may find too large, a bad part it may never need).
Generated = tuple[Any, str]

LEAVES: st.SearchStrategy[Generated] = st.one_of(
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda b: ({"type": "integer", "minimum": b[0], "maximum": b[0] + b[1]}, "valid")
    ),
    st.just(({"type": "boolean"}, "valid")),
    st.just(({"type": "null"}, "valid")),
    st.integers(1, 12).map(lambda n: ({"type": "string", "maxLength": n}, "valid")),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=6, unique=True).map(
        lambda values: ({"enum": values}, "valid")
    ),
    st.integers(500, 5000).map(
        lambda n: ({"enum": [f"value-{i}" for i in range(n)]}, "either")  # huge enums
    ),
    st.just(({"type": "integer", "minimum": 5, "maximum": 1}, "invalid")),
    st.just(({"type": "no-such-type"}, "invalid")),
    st.just(({"$ref": "#/$defs/missing"}, "invalid")),
    st.just(({"type": "string", "pattern": "(unclosed"}, "invalid")),
)


def _worst(parts: list[str]) -> str:
    return "invalid" if "invalid" in parts else "either" if "either" in parts else "valid"


def _object(children: list[tuple[str, Generated]]) -> Generated:
    properties = {name: schema for name, (schema, _) in children}
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return schema, _worst([kind for _, (_, kind) in children])


def _maybe(kind: str) -> str:
    """Inside an array (maybe empty) or one branch of anyOf, a bad part may never be needed."""
    return "either" if kind == "invalid" else kind


def _array(child: Generated, max_items: int) -> Generated:
    return {"type": "array", "items": child[0], "maxItems": max_items}, _maybe(child[1])


def _any_of(children: list[Generated]) -> Generated:
    kind = _maybe(_worst([kind for _, kind in children]))
    return {"anyOf": [schema for schema, _ in children]}, kind


SCHEMAS: st.SearchStrategy[Generated] = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(
            st.tuples(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner),
            max_size=4,
            unique_by=lambda kv: kv[0],
        ).map(_object),
        st.tuples(inner, st.integers(0, 3)).map(lambda a: _array(*a)),
        st.lists(inner, min_size=1, max_size=3).map(_any_of),
    ),  # fmt: skip
    max_leaves=8,
)
RECURSIVE: Generated = (
    {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "minimum": 0, "maximum": 9},
                    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["value", "next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "valid",
)
WIDE: st.SearchStrategy[Generated] = st.integers(50, 400).map(
    lambda n: _object([(f"field_{i}", ({"type": "boolean"}, "valid")) for i in range(n)])
)
DEEP: st.SearchStrategy[Generated] = st.integers(10, 60).map(
    lambda depth: (nested(depth), "valid" if depth + 1 <= 32 else "invalid")
)
ANY_SCHEMA = st.one_of(SCHEMAS, SCHEMAS, st.just(RECURSIVE), WIDE, DEEP)


def _either_when_wide(generated: Generated) -> Generated:
    """A wide object may pass the size bound or not; then it is not a must-serve."""
    schema, kind = generated
    size = len(json.dumps(schema, separators=(",", ":")))
    return schema, "either" if kind == "valid" and size > 8 * 1024 else kind


REQUESTS = st.one_of(
    st.tuples(st.just("response_format"), ANY_SCHEMA.map(_either_when_wide)),
    st.tuples(st.just("structured_outputs"), ANY_SCHEMA.map(_either_when_wide)),
    st.tuples(
        st.sampled_from(["required", "named", "auto"]),
        st.lists(ANY_SCHEMA.map(_either_when_wide), min_size=1, max_size=4),
    ),
)


def request_body(source: str, generated: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The body, the schema of each tool name (or "" for the answer's schema), what to expect."""
    body: dict[str, Any] = {**CHAT, "max_tokens": 48, "temperature": 0}
    if source in ("response_format", "structured_outputs"):
        schema, kind = generated
        if source == "response_format":
            body["response_format"] = json_schema(schema)
        else:
            body["structured_outputs"] = {"json": schema}
        return body, {"": schema}, kind
    schemas = {f"tool_{i}": schema for i, (schema, _) in enumerate(generated)}
    body["tools"] = [tool(name, schema) for name, schema in schemas.items()]
    body["messages"] = user("Call a tool.")
    kinds = [kind for _, kind in generated]
    if source == "named":  # only tool_0 compiles; the others may still be over the bounds
        body["tool_choice"] = {"type": "function", "function": {"name": "tool_0"}}
        others = "either" if "invalid" in kinds[1:] else "valid"
        return body, schemas, _worst([kinds[0], others])
    body["tool_choice"] = source
    if source == "auto":  # nothing compiles: only the bounds can refuse
        return body, schemas, "either"
    return body, schemas, _worst(kinds)


def assert_valid_answer(body: dict[str, Any], schemas: dict[str, Any], answer: dict) -> None:
    choice = answer["choices"][0]
    message = choice["message"]
    if "" in schemas:  # the answer itself follows the schema
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(message["content"]), schemas[""])
        else:
            assert choice["finish_reason"] == "length", choice
        return
    calls = message.get("tool_calls") or []
    if body["tool_choice"] != "auto":
        assert calls or choice["finish_reason"] == "length", choice
    if body["tool_choice"] != "auto" and choice["finish_reason"] == "length":
        calls = calls[:-1]  # a forced call cut off: its arguments are the start of a valid answer
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    if choice["finish_reason"] == "tool_calls":
        assert calls


@settings(settings.get_profile("llmpool-server"), max_examples=EXAMPLES)
@given(request=REQUESTS)
def test_generated_schemas_and_tools_are_answered_validly_or_refused(
    http: httpx.Client, request: tuple[str, Any]
) -> None:
    source, generated = request
    body, schemas, expected = request_body(source, generated)
    response = http.post("/v1/chat/completions", json=body)
    if response.status_code == 200:
        assert expected != "invalid", (body, response.text[:300])
        assert_valid_answer(body, schemas, response.json())
    else:
        assert response.status_code == 400, response.text[:500]
        error = response.json()["error"]
        if error["code"] == "context_length_exceeded":  # tools in the prompt take room too
            assert "tools" in body, error
        else:
            assert error["param"] in ("response_format", "structured_outputs", "tools"), error
            assert expected != "valid", (json.dumps(body)[:500], error)
    assert http.get("/health").status_code == 200


# As ambiguous as a grammar gets over 16 one-letter rules: llguidance's item limit refuses its
# first mask, so the request is ended mid-generation (tests/test_grammar_budget.py for the engine).
REFUSED_GRAMMAR = "start: s\ns: s s | s s s | c\nc: " + " | ".join(
    f'"{c}"' for c in "abcdefghijklmnop"
)


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses -Infinity, Infinity and NaN, as JSON does."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def sse_payloads(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def logprob_values(value: Any) -> list[float]:
    """Every number under a ``logprob`` key or in a ``top_logprobs`` / ``token_logprobs`` list."""
    if isinstance(value, list):
        return [v for item in value for v in logprob_values(item)]
    if not isinstance(value, dict):
        return []
    found = [v for k, v in value.items() if k == "logprob"]
    found += [v for v in value.get("token_logprobs") or [] if v is not None]
    for entry in value.get("top_logprobs") or []:
        found += list(entry.values()) if isinstance(entry, dict) and "logprob" not in entry else []
    return found + [
        v for k, item in value.items() if k != "token_logprobs" for v in logprob_values(item)
    ]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logprobs_under_a_grammar_are_finite_json(http: httpx.Client, route: str) -> None:
    """Masked-out tokens among the top logprobs are reported at -9999.0, never -Infinity."""
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "structured_outputs": {"choice": ["7"]},  # one token allowed, so 4 of the top 5 masked
    }  # fmt: skip
    if route == "chat":
        body |= {"messages": user("A lucky number?"), "logprobs": True, "top_logprobs": 5}
    else:
        body |= {"prompt": "A lucky number:", "logprobs": 5}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    payloads = sse_payloads(http.post(path, json=body | {"stream": True}).text)
    assert payloads[-1] == "[DONE]"
    for document in [answer.text, *payloads[:-1]]:
        values = logprob_values(strict_json(document))
        assert all(v >= -9999.0 for v in values), values
    whole = logprob_values(strict_json(answer.text))
    assert -9999.0 in whole  # masked-out tokens among the top 5
    assert -9999.0 in [v for p in payloads[:-1] for v in logprob_values(strict_json(p))]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_grammar_refused_mid_generation_is_a_400_or_an_error_event(
    http: httpx.Client, route: str
) -> None:
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 8, "structured_outputs": {"grammar": REFUSED_GRAMMAR},
    }  # fmt: skip
    body |= {"messages": user("Letters?")} if route == "chat" else {"prompt": "Letters:"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "grammar_budget_exceeded"
    assert error["param"] == "structured_outputs"
    assert error["type"] == "invalid_request_error"
    payloads = sse_payloads(http.post(path, json=body | {"stream": True}).text)
    assert payloads[-1] == "[DONE]"
    assert strict_json(payloads[-2])["error"]["code"] == "grammar_budget_exceeded"


def test_after_everything_the_server_is_healthy_and_holds_no_blocks(server, http) -> None:
    metrics = server.wait_idle()
    assert metrics["llmpool:kv_cache_usage_perc"] == 0
    for kind in ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call"):
        assert metrics[f'llmpool:structured_output_requests_total{{kind="{kind}"}}'] > 0, kind
        assert metrics[f'llmpool:grammar_compile_seconds_count{{kind="{kind}"}}'] > 0, kind
    assert metrics["llmpool:grammar_budget_exceeded_total"] >= 4  # the refused grammars
    assert metrics["llmpool:grammar_mask_step_seconds_count"] > 0
    assert metrics['llmpool:grammar_budget{limit="step_seconds"}'] == 0.02  # the defaults
    assert metrics['llmpool:grammar_budget{limit="request_seconds"}'] == 5.0
    assert http.get("/health").json() == {"status": "ok"}
    assert "the engine loop failed" not in server.log()
    assert "Traceback" not in server.log()
