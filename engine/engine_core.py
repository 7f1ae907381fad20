"""EngineCore: the step loop (schedule -> forward -> sample) over an engine that engine_builder.py built."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from llmpool.engine.admission import InvalidRequestError, Limits, admit
from llmpool.engine.config import EngineConfig
from llmpool.engine.detokenizer import IncrementalDetokenizer
from llmpool.engine.engine_builder import LoadedEngine
from llmpool.engine.lora.adapter import AdapterError, AdapterWeights, read_adapter
from llmpool.engine.lora.manager import LoadedAdapter, UnknownAdapterError
from llmpool.engine.model_runner import ModelRunner
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.request import Request, RequestStatus
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.scheduler import Scheduler
from llmpool.engine.structured_outputs import (
    GrammarBudget,
    GrammarBudgetExceeded,
    GrammarError,
    StructuredOutputManager,
)
from llmpool.protocol.priority import PRIORITY_CLASSES

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (vLLM counts tokens)
    prefix_cache_hits: int  # of those, tokens found cached
    grammar_mask_seconds: float = 0.0  # structured-output masks, computed beside the forwards
    grammar_wait_seconds: float = 0.0  # of that, what steps waited for after their forward
    grammar_steps: int = 0  # steps that computed masks
    grammar_rows_deferred: int = 0  # rows that skipped a step: their mask was not ready in time
    grammar_budget_exceeded: int = 0  # requests ended for their grammar's budget
    # Speculative decoding (running totals): steps of a request that carried drafts, the draft
    # tokens, and those accepted; the acceptance rate is accepted / draft tokens.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    running_adapters: tuple[str, ...] = ()  # LoRA adapters of the running requests, sorted
    waiting_adapters: tuple[str, ...] = ()  # and of the waiting ones


class EngineCore(LoadedEngine):
    """The synchronous engine: no threads, no event loop; the async front end drives ``step()``.

    What it runs on (the model, its KV cache, kernels) is built by ``LoadedEngine``
    (engine_builder.py); this class adds the scheduler, the runner and the requests' state.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            speculative_config=config.speculative,
        )
        if self.lora is not None:
            # The LoRA table's method, not one of this engine's: a callback holding the engine
            # would make it a reference cycle, whose model and KV cache only a full gc frees.
            self.scheduler.on_finish = self.lora.finished
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer,
            self.shape.vocab_size,
            self.eos_token_ids,
            GrammarBudget(
                config.grammar_compile_fuel,
                config.grammar_step_budget_ms / 1000,
                config.grammar_request_budget_s,
            ),
        )
        self.runner = ModelRunner(
            self.model, self.kv_caches, self.kv_cache_manager, self.device, self.structured_outputs
        )
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.limits = Limits(
            vocab_size=self.shape.vocab_size,
            max_model_len=self.max_model_len,
            priority_floor=config.request_priority_floor,
        )
        self._log_ready()

    def _log_ready(self) -> None:
        config = self.config
        num_blocks = self.kv_cache_manager.num_total_blocks
        logger.info(
            "engine ready: %s (%s) on %s/%s (%s), backend %s, %d KV blocks of %d tokens (%s tokens),"
            " max_model_len %d, quantization %s, KV cache %s",
            self.resolved.source,
            self.shape.num_layers,
            self.device,
            self.resolved_dtype.name,
            self.resolved_dtype.reason,
            self.backend.name,
            num_blocks,
            config.block_size,
            f"{num_blocks * config.block_size:,}",
            self.max_model_len,
            config.quantization,
            self.kv_dtype_name,
        )

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request, or raise InvalidRequestError (admission.py) and queue nothing.

        ``priority`` None means the engine's ``priority_class``; ``cache_salt`` keeps the
        request's prefix-cache blocks apart from those of requests with another salt;
        ``lora_name`` runs it with a loaded adapter (UnknownAdapterError if none is).
        """
        if lora_name is not None and (self.lora is None or lora_name not in self.lora.registry):
            raise UnknownAdapterError(lora_name)
        if priority is None:
            priority = PRIORITY_CLASSES[self.config.priority_class]
        sampling_params = admit(prompt_token_ids, sampling_params, priority, self.limits)
        grammar = None
        if sampling_params.structured_outputs is not None:
            try:
                grammar = self.structured_outputs.matcher(sampling_params.structured_outputs)
            except GrammarError as error:
                raise InvalidRequestError(str(error), param="structured_outputs") from None
        request = Request(
            request_id,
            prompt_token_ids,
            sampling_params,
            self.eos_token_ids,
            arrival_time,
            priority,
            cache_salt=cache_salt,
            grammar=grammar,
            lora=None if lora_name is None or self.lora is None else self.lora.acquire(lora_name),
        )
        try:
            self.scheduler.add_request(request)
        except ValueError:
            if self.lora is not None:
                self.lora.finished(request)
            raise
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            sampling_params.stop,
            sampling_params.include_stop_str_in_output,
            sampling_params.skip_special_tokens,
        )

    # --- adapters -------------------------------------------------------------------------

    def prepare_adapter(self, name: str, path: str, revision: str | None = None) -> AdapterWeights:
        """Read and check an adapter (any thread: it touches no engine state but the record of
        failures); :meth:`install_adapter` then puts it in a slot."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        try:
            return read_adapter(
                name,
                path,
                shape=self.shape,
                max_rank=self.lora.max_rank,
                dtype=self.dtype,
                revision=revision,
            )
        except AdapterError as error:
            self.lora.record_failure(name, path, revision, error)
            raise

    def install_adapter(self, weights: AdapterWeights, replace: bool = False) -> LoadedAdapter:
        """Put a prepared adapter in a slot (the engine thread, between steps). A conflict (the
        name holds other files, no free slot) is not recorded as a failure of the adapter."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        return self.lora.install(weights, replace)

    def load_adapter(self, name: str, path: str, revision: str | None = None) -> LoadedAdapter:
        return self.install_adapter(self.prepare_adapter(name, path, revision))

    def unload_adapter(self, name: str) -> None:
        """Unload at once for new requests; running ones finish on the adapter's slot."""
        if self.lora is None:
            raise UnknownAdapterError(name)
        self.lora.unload(name)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
            self.detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedule, run and sample one batch; the deltas of the requests it advanced."""
        if self.compile is not None and self.compile.running:
            with self.compile.serving():
                return self._step()
        return self._step()

    def _step(self) -> list[RequestDelta]:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.runner.timings.schedule += time.perf_counter() - started
        if scheduled.is_empty:
            return []
        result = self.runner.execute(scheduled)
        sampled_at = time.perf_counter()
        deltas = [self._fail(request, error) for request, error in result.failed]
        if result.failed:
            scheduled = scheduled.without({request.request_id for request, _ in result.failed})
        token_by_request = {
            request.request_id: token
            for request, token in zip(
                result.sampling_requests, result.sampled.token_ids, strict=True
            )
        }
        logprobs_by_request = {
            request.request_id: entry
            for request, entry in zip(
                result.sampling_requests, result.sampled.logprobs, strict=True
            )
        }
        changed = self.scheduler.update_from_output(
            scheduled, token_by_request, frozenset(r.request_id for r in result.deferred)
        )
        for request, num_new in changed:
            try:
                deltas.append(
                    self._delta(request, num_new, logprobs_by_request[request.request_id])
                )
            except Exception as error:  # output processing of this request alone (detokenizing)
                deltas.append(self._fail(request, error))
        self.runner.timings.process_outputs += time.perf_counter() - sampled_at
        return deltas

    def _fail(self, request: Request, error: Exception) -> RequestDelta:
        """End one request whose own work raised; its blocks are freed and the loop goes on."""
        code = None
        if isinstance(error, GrammarBudgetExceeded):  # the request's, not the engine's fault
            code = error.code
            logger.warning("request %s was ended: %s", request.request_id, error)
        else:
            logger.error(
                "request %s failed in the engine step and was ended: %s: %s",
                request.request_id, type(error).__name__, error, exc_info=error,
            )  # fmt: skip
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        self.detokenizers.pop(request.request_id, None)
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=RequestStatus.FINISHED_ERROR.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            error=str(error) if code else f"{type(error).__name__}: {error}",
            error_code=code,
        )

    def _delta(
        self, request: Request, num_new: int, logprobs: dict[int, float] | None
    ) -> RequestDelta:
        """The step's ``num_new`` tokens through the grammar and the detokenizer, in order; a
        stop string ends the request at the token that completed it, and drops those after."""
        new_token_ids = request.all_token_ids[-num_new:]
        detokenizer = self.detokenizers[request.request_id]
        for index, token_id in enumerate(new_token_ids):
            if self._ends_at(request, detokenizer, token_id):
                dropped = len(new_token_ids) - index - 1
                if dropped:
                    del request.all_token_ids[-dropped:]
                    new_token_ids = new_token_ids[: index + 1]
                break
        finished = request.status.finished
        if finished:
            del self.detokenizers[request.request_id]
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_text=detokenizer.take_new_text(finished),
            new_logprobs=[logprobs] if logprobs is not None else [],
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )

    def _ends_at(
        self, request: Request, detokenizer: IncrementalDetokenizer, token_id: int
    ) -> bool:
        """Feed one token to the grammar and the detokenizer; True if either ends the request
        (the scheduler's stops, checked before, end it at its last new token only)."""
        ended = False
        if request.grammar is not None:
            request.grammar.accept(token_id)
            if request.grammar.is_complete:
                ended = True
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            elif not request.status.finished:  # the next mask starts now, beside the next forward
                self.structured_outputs.start_mask(request.grammar)
        stop_string = detokenizer.add_token(token_id)
        if stop_string is not None and not request.status.finished:
            ended = True
            request.stop_reason = stop_string
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return ended

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.num_total_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            grammar_mask_seconds=self.runner.timings.grammar_mask,
            grammar_wait_seconds=self.runner.timings.grammar_wait,
            grammar_steps=self.runner.timings.grammar_steps,
            grammar_rows_deferred=self.runner.timings.grammar_deferred,
            grammar_budget_exceeded=self.runner.timings.grammar_budget_exceeded,
            spec_decode_num_drafts=self.scheduler.spec_decoding.num_drafts,
            spec_decode_num_draft_tokens=self.scheduler.spec_decoding.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.scheduler.spec_decoding.num_accepted_tokens,
            running_adapters=_adapter_names(self.scheduler.running),
            waiting_adapters=_adapter_names(self.scheduler.waiting),
        )


def _adapter_names(requests: list[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))
