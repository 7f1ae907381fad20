"""Tool results checked against the calls they answer, as OpenAI checks them.

An assistant message with ``tool_calls`` must be followed by one ``tool`` message per call
(each ``tool_call_id`` one of that message's call ids, none answered twice) before any other
message; a ``tool`` message must answer the assistant message just before its run of results.
OpenAI's 400s: "messages with role 'tool' must be a response to a preceeding message with
'tool_calls'" and "An assistant message with 'tool_calls' must be followed by tool messages
responding to each 'tool_call_id'"; the ``param`` names the message and field.
"""

from __future__ import annotations

from typing import Any

from llmpool.protocol.errors import bad_request


def check_tool_replies(messages: list[dict[str, Any]]) -> None:
    """Raise a 400 naming the field where ``messages`` (parsed: calls and ids are strings)
    answer a call twice, answer none, or leave one of an assistant's calls unanswered."""
    turn: int | None = None  # the index of the assistant message whose calls are answered now
    unanswered: list[str] = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            if turn is None:
                raise bad_request(
                    f"{param}: messages with role 'tool' must be a response to a preceding"
                    " message with 'tool_calls'",
                    param=f"{param}.role",
                )
            if call_id not in unanswered:
                asked = [c["id"] for c in messages[turn]["tool_calls"]]
                raise bad_request(
                    f"{param}.tool_call_id {call_id!r} "
                    + ("answers a call already answered" if call_id in asked else "is not")
                    + f" in the tool_calls of messages[{turn}]",
                    param=f"{param}.tool_call_id",
                )
            unanswered.remove(call_id)
            continue
        _check_answered(turn, unanswered)
        calls = message.get("tool_calls") or []
        ids = [call["id"] for call in calls]
        if len(set(ids)) != len(ids):
            raise bad_request(
                f"{param}.tool_calls must have distinct ids", param=f"{param}.tool_calls"
            )
        turn, unanswered = (index, ids) if calls else (None, [])
    _check_answered(turn, unanswered)


def _check_answered(turn: int | None, unanswered: list[str]) -> None:
    if turn is not None and unanswered:
        raise bad_request(
            f"an assistant message with 'tool_calls' must be followed by tool messages"
            f" responding to each 'tool_call_id'; messages[{turn}]'s calls"
            f" {', '.join(map(repr, unanswered))} have none",
            param=f"messages[{turn}].tool_calls",
        )
