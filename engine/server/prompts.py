"""Prompt token ids from completion prompts and chat messages (the model's template or --chat-template).

Tools go to the template as ``apply_chat_template(tools=...)`` when the template renders them;
a template that never mentions ``tools`` (SmolLM2's) would drop them silently, so then the tools,
earlier calls and their results are written into the messages in Hermes's format instead.
"""

from __future__ import annotations

from typing import Any

import jinja2

from llmpool.engine.server.tool_calls import Function, hermes_messages, template_messages
from llmpool.protocol.errors import bad_request

# Text of more than this many characters per token of the context window is first tokenized in
# growing parts (each PROBE_GROWTH times the last): once a part alone overflows the window, the
# prompt is refused without tokenizing the rest (16 MiB of text takes ~20 s of CPU to tokenize
# whole). Tokens average ~4 characters, so a prompt that fits is rarely probed, and one that
# does not costs at most a few times the characters that fill the window, whatever its length
# (a run of spaces is ~64 characters per token).
PROBE_CHARS_PER_TOKEN = 16
PROBE_GROWTH = 4


class PromptBuilder:
    """Tokenizes exactly as the offline ``LLM.generate`` and ``LLM.chat`` do, so outputs agree."""

    def __init__(self, tokenizer: Any, chat_template: str | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.template_knows_tools = "tools" in (self.chat_template or "")
        self.max_model_len = max_model_len

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self._encode(prompt, add_special_tokens=True, param="prompt")

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        functions: list[Function] | None = None,
    ) -> list[int]:
        if not self.chat_template:
            raise bad_request(
                "this model has no chat template; start the server with --chat-template FILE,"
                " or use /v1/completions",
                param="messages",
            )
        tools = None
        if self.template_knows_tools:
            messages = template_messages(messages)
            tools = [f.to_openai() for f in functions] if functions else None
        else:
            messages = hermes_messages(messages, functions or [])
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except jinja2.TemplateError as error:
            raise bad_request(
                f"the chat template rejected the messages: {error}", param="messages"
            ) from None
        # The template already wrote any BOS; adding special tokens again would double it.
        return self._encode(text, add_special_tokens=False, param="messages")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        probe = self.max_model_len * PROBE_CHARS_PER_TOKEN
        while probe < len(text):
            head = self.tokenizer.encode(text[:probe], add_special_tokens=add_special_tokens)
            if len(head) > self.max_model_len:
                raise bad_request(
                    f"this model's maximum context length is {self.max_model_len:,} tokens; the"
                    f" first {probe:,} of the prompt's {len(text):,} characters alone are"
                    f" {len(head):,} tokens",
                    param=param,
                    code="context_length_exceeded",
                )
            probe *= PROBE_GROWTH
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
