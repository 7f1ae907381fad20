"""Tool results are checked against the calls they answer, as OpenAI checks them: a 400 naming
the message and field (protocol.requests, which the engine parses chat requests with)."""

from __future__ import annotations

from typing import Any

import pytest

from llmpool.protocol.errors import APIError
from llmpool.protocol.requests import parse_chat_request

USER = {"role": "user", "content": "Weather in Oslo and Bergen?"}


def call(call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }


def calls(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [call(i) for i in ids]}


def result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "-3 C"}


def parse(messages: list[dict[str, Any]]) -> None:
    parse_chat_request({"model": "m", "messages": messages})


VALID = {
    "one call answered": [USER, calls("a"), result("a")],
    "three calls answered in another order": [
        USER, calls("a", "b", "c"), result("c"), result("a"), result("b"),
    ],
    "two turns, then the user": [
        USER, calls("a"), result("a"), calls("b"), result("b"),
        {"role": "assistant", "content": "Cold."}, USER,
    ],
    "an id used again in a later turn": [USER, calls("a"), result("a"), calls("a"), result("a")],
}  # fmt: skip


@pytest.mark.parametrize("case", list(VALID))
def test_answers_to_the_calls_just_made_are_accepted(case: str) -> None:
    parse(VALID[case])


INVALID = {
    "one result for three calls": (
        [USER, calls("a", "b", "c"), result("a"), USER],
        "messages[1].tool_calls",
    ),
    "calls left unanswered at the end": ([USER, calls("a", "b"), result("b")], "messages[1].tool_calls"),
    "an unknown id": ([USER, calls("a"), result("z")], "messages[2].tool_call_id"),
    "an id answered twice": ([USER, calls("a", "b"), result("a"), result("a")], "messages[3].tool_call_id"),
    "an id of an earlier turn": (
        [USER, calls("a"), result("a"), calls("b"), result("a")],
        "messages[4].tool_call_id",
    ),
    "a result with no call before it": ([USER, result("a")], "messages[1].role"),
    "a result after the user spoke": ([USER, calls("a"), result("a"), USER, result("a")], "messages[4].role"),
    "a call id twice in one message": ([USER, calls("a", "a"), result("a")], "messages[1].tool_calls"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(INVALID))
def test_results_that_do_not_answer_the_calls_are_a_400_naming_the_field(case: str) -> None:
    messages, param = INVALID[case]
    with pytest.raises(APIError) as raised:
        parse(messages)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message
