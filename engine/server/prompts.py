"""Prompt token ids from completion prompts and chat messages (the model's template or --chat-template).

Tools go to the template as ``apply_chat_template(tools=...)`` when the template renders them;
a template that never mentions ``tools`` (SmolLM2's) would drop them silently, so then the tools,
earlier calls and their results are written into the messages in Hermes's format instead.
"""

from __future__ import annotations

from typing import Any

import jinja2

from llmpool.engine.server.protocol import bad_request
from llmpool.engine.server.tool_calls import Function, hermes_messages, template_messages


class PromptBuilder:
    """Tokenizes exactly as the offline ``LLM.generate`` and ``LLM.chat`` do, so outputs agree."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.template_knows_tools = "tools" in (self.chat_template or "")

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

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
        return self.tokenizer.encode(text, add_special_tokens=False)
