"""Request: one generation's tokens, counters and lifecycle inside the engine."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from llmpool.engine.block_hash import BlockHash
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.structured_outputs import GrammarMatcher

if TYPE_CHECKING:
    from llmpool.engine.lora.manager import LoadedAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed this request alone; the loop went on

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class Request:
    """Everything the scheduler and runner know about one sequence.

    The one scheduling rule: ``num_computed_tokens`` catches up with ``num_tokens``. A prompt
    chunk, a decode and a recompute after preemption are all that rule with different gaps.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        grammar: GrammarMatcher | None = None,
        lora: LoadedAdapter | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # The adapter the request runs with (None: the base model). Its blocks hold K/V the
        # adapter computed, so the adapter's content digest salts their hashes: the same prompt
        # never shares a block across adapters, and a reload of the same files shares again.
        self.lora = lora
        self.block_salt = cache_salt if lora is None else f"{cache_salt or ''}\0lora:{lora.digest}"
        # Its structured-output grammar, advanced by every token the request generates.
        self.grammar = grammar
        # Hashes of the full blocks of all_token_ids so far (prefix caching), filled lazily.
        self.block_hashes: list[BlockHash] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Logprobs of generated tokens, filled by the engine when asked for.
        self.output_logprobs: list[dict[int, float]] = []
        # Draft tokens the scheduler gave this step, verified by the sampler (spec_decode).
        self.spec_token_ids: list[int] = []

    @property
    def can_speculate(self) -> bool:
        """Whether drafts leave what this request gets unchanged (docs/architecture.md).

        Grammars, penalties and logprobs are computed per step from the tokens before it; a
        seed fixes one draw per token from the request's generator. Verifying drafts would
        change those, so such requests run without drafts, in the same batches.
        """
        params = self.sampling_params
        return (
            self.grammar is None
            and params.seed is None
            and params.logprobs is None
            and not params.uses_penalties
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower priority value first, then earlier arrival (vLLM's convention)."""
        return (self.priority, self.arrival_time)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
