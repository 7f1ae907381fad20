"""Parsing and tokenizing a request run off the event loop: /health answers while a prompt is
being tokenized. The tokenizer is held mid-call until the test has its /health answer, so the
test shows the order of events, not how long anything took."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from transformers import AutoTokenizer

from llmpool.engine import model_source
from llmpool.engine.server.app import OpenAIServer, ServerSettings
from llmpool.engine.structured_outputs import GrammarBudget

MODEL = "smollm2-135m-instruct"
HOLD_SECONDS = 30  # only reached when tokenizing blocks the loop, i.e. when the test fails


class HeldTokenizer:
    """The real tokenizer, except that ``encode`` waits until the test lets it go on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.entered.set()
        if not self.release.wait(HOLD_SECONDS):
            raise AssertionError("nobody released the tokenizer: the event loop was blocked")
        return self._tokenizer.encode(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(model_source.resolve(f"builtin://{MODEL}").folder)


def server_over(tokenizer: HeldTokenizer) -> OpenAIServer:
    """The HTTP front of a server whose engine never started: a request that gets through
    preparation is answered 503, which is all these tests need."""
    core = SimpleNamespace(
        tokenizer=tokenizer,
        max_model_len=64,
        structured_outputs=SimpleNamespace(budget=GrammarBudget()),
        lora=None,
    )
    return OpenAIServer(core, ServerSettings(served_model_name=MODEL))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Hello"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_health_answers_while_a_prompt_tokenizes(tokenizer, path, body) -> None:
    held = HeldTokenizer(tokenizer)
    server = server_over(held)
    app = Starlette(routes=server.routes())  # no lifespan: the engine is not started
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        generation = asyncio.create_task(http.post(path, json=body))
        while not held.entered.is_set():
            await asyncio.sleep(0.01)
        health = await http.get("/health")
        assert health.status_code == 200
        assert not generation.done()
        held.release.set()
        response = await generation
    assert response.status_code == 503, response.text  # prepared, then the stopped engine
