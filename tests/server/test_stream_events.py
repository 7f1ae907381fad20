"""Stream events are exactly the chunks OpenAI clients parse: the envelope serialized once per
request must give the same bytes as serializing each whole chunk."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from llmpool.engine import model_source
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.server.responses import SSE_DONE, ResponseBuilder, sse_event


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(model_source.resolve(None).folder)


def whole_chunk(builder: ResponseBuilder, choice: dict[str, Any]) -> bytes:
    object_name = "chat.completion.chunk" if builder.kind == "chat" else "text_completion"
    chunk = {
        "id": builder.id,
        "object": object_name,
        "created": builder.created,
        "model": builder.model,
        "choices": [choice],
    }
    return sse_event(chunk)


DELTAS = [
    RequestDelta("r-0", [42], "Hello"),
    RequestDelta("r-0", [43], ""),  # half a character: no text yet
    RequestDelta("r-0", [44], ' "é"\n', new_logprobs=[{44: -0.5, 45: -1.0}]),
    RequestDelta("r-0", [2], "", finished=True, finish_reason="stop", stop_reason=2),
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("top_logprobs", [None, 1])
def test_delta_events_equal_whole_chunks(tokenizer: Any, kind: str, top_logprobs: int | None):
    builder = ResponseBuilder(kind, "cmpl-1", "m\u00e9", tokenizer, top_logprobs)
    for delta in DELTAS:
        text = delta.new_text
        content = {"delta": {"content": text} if text else {}} if kind == "chat" else {"text": text}
        ended = delta.finished
        choice = {
            "index": 3,
            **content,
            "logprobs": builder._logprobs(delta.new_token_ids, delta.new_logprobs),
            "finish_reason": delta.finish_reason if ended else None,
            "stop_reason": delta.stop_reason if ended else None,
        }
        event = builder.delta_event(3, delta)
        assert event == whole_chunk(builder, choice)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event.removeprefix(b"data: "))["choices"][0]["index"] == 3


def test_role_usage_and_done_events(tokenizer: Any) -> None:
    builder = ResponseBuilder("chat", "chatcmpl-1", "m", tokenizer, None)
    role = {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}  # fmt: skip
    assert builder.role_event(1) == whole_chunk(builder, role)
    usage = json.loads(builder.usage_event(5, 7).removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
    }  # fmt: skip
    assert SSE_DONE == b"data: [DONE]\n\n"
