"""ModelRunner: turns a SchedulerOutput into flat tensors, runs one forward and samples.

Preparing inputs and sampling are per-request work done in batches; if a batch raises, the
runner redoes it one request at a time, so that the request at fault fails alone (its error is
returned) and the others go on. The forward pass has no such fallback: a fault there is the
model's, and it stops the loop.

A row whose grammar mask is not ready within the step budget is deferred: it samples nothing,
and the scheduler counts its last token as not computed, so the next step runs it again
(structured_outputs.py, ``GrammarBudget``).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from llmpool.engine.attention import AttentionMetadata
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.lora.ops import LoraBatch
from llmpool.engine.models.llama import LlamaForCausalLM
from llmpool.engine.request import Request
from llmpool.engine.sampler import Sampler, SamplerOutput
from llmpool.engine.scheduler import SchedulerOutput
from llmpool.engine.structured_outputs import GrammarMatcher, StructuredOutputManager

# When every row of a step waits for its mask, the step waits this long for one of them rather
# than run the same forward again at once.
IDLE_MASK_WAIT_SECONDS = 0.05


@dataclass
class StepTimings:
    """Seconds spent in each phase of the steps so far (what `llmpool bench` reports)."""

    schedule: float = 0.0
    prepare_inputs: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process_outputs: float = 0.0  # scheduler bookkeeping, stop checks and detokenization
    steps: int = 0
    grammar_mask: float = 0.0  # structured-output masks, computed beside the forward pass
    grammar_wait: float = 0.0  # of that, the part the step waited for after its forward
    grammar_steps: int = 0  # steps that had masks to compute
    grammar_deferred: int = 0  # rows that sampled nothing: their mask was not ready in budget
    grammar_budget_exceeded: int = 0  # requests ended: mask budget spent, or grammar refused


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled
    sampling_requests: list[Request] = field(default_factory=list)
    lora: LoraBatch | None = None  # rows that run with an adapter, grouped by slot


@dataclass
class StepResult:
    sampling_requests: list[Request]  # the requests that sampled, in the order of the tokens
    sampled: SamplerOutput
    failed: list[tuple[Request, Exception]]  # requests whose own rows raised, and why
    deferred: list[Request] = field(default_factory=list)  # rows whose mask was not ready


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache_manager: KVCacheManager,
        device: torch.device,
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.device = device
        self.sampler = Sampler()
        self.timings = StepTimings()
        self.structured_outputs = structured_outputs

    def prepare_inputs(self, scheduled: SchedulerOutput) -> ModelInputs:
        """Flatten the step: token ids, positions, slots and block tables, built with numpy."""
        requests = scheduled.requests
        num_scheduled = np.array(scheduled.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
        query_start_loc = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        seq_lens = num_computed + num_scheduled
        total = int(query_start_loc[-1])

        token_ids = np.fromiter(
            (
                token
                for r, start, count in zip(requests, num_computed, num_scheduled, strict=True)
                for token in _step_tokens(r, start, count)
            ),
            dtype=np.int64,
            count=total,
        )
        positions = np.arange(total, dtype=np.int64) - np.repeat(
            query_start_loc[:-1] - num_computed, num_scheduled
        )
        tables = [self.kv_cache_manager.block_tables[r.request_id] for r in requests]
        block_tables = np.zeros((len(requests), max(len(t) for t in tables)), dtype=np.int64)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        token_rows = np.repeat(np.arange(len(requests)), num_scheduled)
        slot_mapping = (
            block_tables[token_rows, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        # A request samples when this step brings its computed tokens up to all its tokens and
        # drafts; it takes logits at its last token and at each draft.
        num_drafts = np.array([len(r.spec_token_ids) for r in requests], dtype=np.int64)
        samples = seq_lens == np.array([r.num_tokens for r in requests]) + num_drafts
        num_logits = num_drafts[samples] + 1
        logits_indices = (
            np.repeat(query_start_loc[1:][samples] - num_logits, num_logits)
            + np.arange(int(num_logits.sum()))
            - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        )

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        return ModelInputs(
            input_ids=torch.from_numpy(token_ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            meta=meta,
            logits_indices=torch.from_numpy(logits_indices).to(device),
            sampling_requests=[r for r, s in zip(requests, samples, strict=True) if s],
            lora=self._lora_batch(requests, num_scheduled),
        )

    def _lora_batch(self, requests: list[Request], num_scheduled: np.ndarray) -> LoraBatch | None:
        """The step's adapter rows grouped by slot, or None when every row is the base model's
        (a base-only step pays nothing for LoRA)."""
        if all(r.lora is None for r in requests):
            return None
        slots = np.array([-1 if r.lora is None else r.lora.slot for r in requests], dtype=np.int64)
        token_slots = np.repeat(slots, num_scheduled)
        order = np.argsort(token_slots, kind="stable")
        order = order[token_slots[order] >= 0]
        group_slots, starts, counts = np.unique(
            token_slots[order], return_index=True, return_counts=True
        )
        group_starts = np.append(starts, len(order))
        device = self.device
        return LoraBatch(
            token_slots=torch.from_numpy(token_slots).to(device),
            sorted_tokens=torch.from_numpy(order).to(device),
            group_slots=torch.from_numpy(group_slots).to(device),
            group_starts=torch.from_numpy(group_starts.astype(np.int64)).to(device),
            max_group_len=int(counts.max()),
        )

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> StepResult:
        """One forward over the step's tokens; returns who sampled what, and who failed."""
        started = time.perf_counter()
        failed: list[tuple[Request, Exception]] = []
        inputs = self._prepare_isolating(scheduled, failed)
        prepared = time.perf_counter()
        if inputs is None:
            self.timings.prepare_inputs += prepared - started
            return StepResult([], SamplerOutput(token_ids=[], logprobs=[]), failed)
        grammars = self._start_masks(inputs.sampling_requests)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.lora
        )
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices)).cpu()
        forwarded = time.perf_counter()
        requests, logits, allowed, deferred = self._finish_masks(
            inputs.sampling_requests, grammars, logits, failed
        )
        if deferred and len(deferred) == len(scheduled.requests):
            self._wait_for_any(deferred)
        masked = time.perf_counter()
        sampling_requests, sampled = self._sample_isolating(logits, requests, allowed, failed)
        finished = time.perf_counter()
        self.timings.prepare_inputs += prepared - started
        self.timings.forward += forwarded - prepared
        self.timings.grammar_wait += masked - forwarded
        self.timings.sample += finished - masked
        self.timings.steps += 1
        return StepResult(sampling_requests, sampled, failed, deferred)

    def _start_masks(self, requests: list[Request]) -> list[GrammarMatcher | None]:
        """Start (unless started) the next masks of the rows that sample with a grammar."""
        grammars = [r.grammar for r in requests]
        if self.structured_outputs is not None:
            for grammar in grammars:
                if grammar is not None:
                    self.structured_outputs.start_mask(grammar)
        return grammars

    def _finish_masks(
        self,
        requests: list[Request],
        grammars: list[GrammarMatcher | None],
        logits: torch.Tensor,
        failed: list[tuple[Request, Exception]],
    ) -> tuple[list[Request], torch.Tensor, torch.Tensor | None, list[Request]]:
        """The rows that sample, their logits and masks, and the rows deferred.

        A grammar row waits for its mask up to the step budget; not ready, it is deferred; over
        its request budget (or refused by llguidance), it fails with GrammarBudgetExceeded.
        """
        manager = self.structured_outputs
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if manager is None or not rows:
            return requests, logits, None, []
        outcomes = dict(
            zip(rows, manager.collect([g for g in grammars if g is not None]), strict=True)
        )
        self.timings.grammar_steps += 1
        kept: list[int] = []
        masks: list[np.ndarray | None] = []
        deferred: list[Request] = []
        for index, request in enumerate(requests):
            outcome = outcomes.get(index)
            if isinstance(outcome, Exception):
                self.timings.grammar_budget_exceeded += 1
                failed.append((request, outcome))
            elif index in outcomes and outcome is None:
                self.timings.grammar_deferred += 1
                deferred.append(request)
            else:
                if outcome is not None and request.grammar is not None:
                    self.timings.grammar_mask += request.grammar.last_mask_seconds
                kept.append(index)
                masks.append(outcome)
        allowed = (
            torch.from_numpy(
                np.stack(
                    [np.ones(manager.vocab_size, dtype=bool) if m is None else m for m in masks]
                )
            )
            if masks
            else None
        )
        if len(kept) == len(requests):
            return requests, logits, allowed, deferred
        # Each request has one logits row and one per draft (grammar rows carry no drafts).
        counts = np.array([len(r.spec_token_ids) + 1 for r in requests])
        starts = np.cumsum(counts) - counts
        logit_rows = [row for i in kept for row in range(starts[i], starts[i] + counts[i])]
        return (
            [requests[i] for i in kept],
            logits.index_select(0, torch.tensor(logit_rows, dtype=torch.long)),
            allowed,
            deferred,
        )

    @staticmethod
    def _wait_for_any(deferred: list[Request]) -> None:
        """Every row of the step waits for its mask: wait for one before stepping again."""
        futures = [r.grammar.next_mask for r in deferred if r.grammar is not None]
        wait([f for f in futures if f is not None], IDLE_MASK_WAIT_SECONDS, FIRST_COMPLETED)

    def _prepare_isolating(
        self, scheduled: SchedulerOutput, failed: list[tuple[Request, Exception]]
    ) -> ModelInputs | None:
        """The step's inputs without the requests whose own inputs cannot be built."""
        try:
            return self.prepare_inputs(scheduled)
        except Exception:
            pass
        culprits = set()
        for request, count in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True):
            try:
                self.prepare_inputs(SchedulerOutput([request], [count]))
            except Exception as error:
                failed.append((request, error))
                culprits.add(request.request_id)
        rest = scheduled.without(culprits)
        # No culprit found means the fault is not one request's: prepare_inputs raises again.
        return self.prepare_inputs(rest) if rest.requests else None

    def _sample_isolating(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        allowed: torch.Tensor | None,
        failed: list[tuple[Request, Exception]],
    ) -> tuple[list[Request], SamplerOutput]:
        """Sample the batch; if that raises, sample row by row and fail the rows that raise."""
        if not requests:
            return [], SamplerOutput(token_ids=[], logprobs=[])
        drafts = [r.spec_token_ids for r in requests]
        try:
            return requests, self.sampler(logits, requests, allowed, drafts)
        except Exception:
            pass
        kept: list[Request] = []
        token_ids: list[list[int]] = []
        logprobs: list[dict[int, float] | None] = []
        start = 0
        for index, request in enumerate(requests):
            end = start + len(request.spec_token_ids) + 1
            try:
                one = self.sampler(
                    logits[start:end],
                    [request],
                    None if allowed is None else allowed[index : index + 1],
                    [request.spec_token_ids],
                )
            except Exception as error:
                failed.append((request, error))
                continue
            finally:
                start = end
            kept.append(request)
            token_ids += one.token_ids
            logprobs += one.logprobs
        return kept, SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _step_tokens(request: Request, start: int, count: int) -> list[int]:
    """The ``count`` tokens from position ``start``: the request's own, then its drafts."""
    tokens = request.all_token_ids[start : start + count]
    if len(tokens) < count:
        tokens += request.spec_token_ids[: count - len(tokens)]
    return tokens
