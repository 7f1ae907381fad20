"""LLM: the offline API, shaped like vLLM's so that its users feel at home."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore, EngineStats
from llmpool.engine.lora import LoRARequest
from llmpool.engine.outputs import CompletionOutput, RequestOutput
from llmpool.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM(model=None)`` serves the built-in model; other keywords are EngineConfig fields."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **engine_args))
        # Offline generation has no first requests to serve eager: compiled before it returns.
        self.engine.wait_for_compile()
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def num_preemptions(self) -> int:
        return self.engine.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``lora_request`` runs all prompts, or each prompt, with an adapter (None: the base
        model); an adapter not loaded yet is loaded from its ``lora_path`` first."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts))
        adapters = self._adapters(lora_request, len(prompts))
        results: dict[str, RequestOutput] = {}
        try:
            self._add(prompts, params, priority, adapters, results)
            self._run(results, sum(p.n for p in params), use_tqdm)
        except BaseException:
            # An error, or Ctrl-C: none of this call's requests may stay queued or hold blocks.
            self.engine.abort_requests(
                [f"{rid}-{c}" for rid, out in results.items() for c in range(len(out.outputs))]
            )
            raise
        for output in results.values():
            output.finished = True
        return list(results.values())

    def _adapters(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[str | None]:
        """Each prompt's adapter name, loading the adapters the engine does not hold yet."""
        requests = (
            [lora_request] * count
            if lora_request is None or isinstance(lora_request, LoRARequest)
            else list(lora_request)
        )
        if len(requests) != count:
            raise ValueError(f"{len(requests)} LoRA requests for {count} prompts")
        loaded = self.engine.lora.registry if self.engine.lora is not None else {}
        for request in {r for r in requests if r is not None and r.lora_name not in loaded}:
            self.engine.load_adapter(request.lora_name, request.lora_path, request.revision)
        return [None if r is None else r.lora_name for r in requests]

    def _add(
        self,
        prompts: Sequence[Prompt],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
        adapters: list[str | None],
        results: dict[str, RequestOutput],
    ) -> None:
        """Queue every prompt's children; ``results`` gets one entry per prompt as it is added."""
        for index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(next(self._ids))
            results[request_id] = RequestOutput(
                request_id=request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=token_ids,
                outputs=[CompletionOutput(index=i) for i in range(prompt_params.n)],
            )
            for child, child_params in enumerate(_children(prompt_params)):
                self.engine.add_request(
                    f"{request_id}-{child}",
                    token_ids,
                    child_params,
                    priority=priority[index] if priority else None,
                    lora_name=adapters[index],
                )

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        """Step the engine until every request is done, gathering the deltas into ``results``."""
        with tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    parent_id, child = delta.request_id.rsplit("-", 1)
                    completion = results[parent_id].outputs[int(child)]
                    completion.token_ids.extend(delta.new_token_ids)
                    completion.text += delta.new_text
                    if delta.new_logprobs:
                        completion.logprobs = (completion.logprobs or []) + delta.new_logprobs
                    if delta.finished:
                        completion.finish_reason = delta.finish_reason
                        completion.stop_reason = delta.stop_reason
                        progress.update()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
            for conversation in conversations
        ]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)


def _children(params: SamplingParams) -> list[SamplingParams]:
    """``n`` samples of one prompt run as ``n`` requests; seeded ones get consecutive seeds."""
    if params.n == 1:
        return [params]
    return [params.for_choice(child) for child in range(params.n)]


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
    return list(sampling_params)
