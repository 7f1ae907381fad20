"""Scheduler: decides which requests advance by how many tokens in each step.

One rule (as in vLLM V1): every request has ``num_tokens`` and ``num_computed_tokens``, and each
step hands out a token budget so that computed catches up with total, running requests first.
Prefill chunks, decodes and recomputes after preemption are the same thing with different gaps.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.request import Request, RequestStatus
from llmpool.engine.spec_decode.config import SpeculativeConfig
from llmpool.engine.spec_decode.ngram import NgramProposer


@dataclass
class SpecDecodingCounts:
    """Running totals of speculation (vLLM's spec_decode_* counters): the acceptance rate is
    ``num_accepted_tokens / num_draft_tokens``."""

    num_drafts: int = 0  # requests-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class SchedulerOutput:
    """The plan for one step, handed to the model runner as plain data."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def without(self, request_ids: set[str]) -> SchedulerOutput:
        """The same plan minus some requests (those the runner failed)."""
        kept = [
            (request, count)
            for request, count in zip(self.requests, self.num_scheduled_tokens, strict=True)
            if request.request_id not in request_ids
        ]
        return SchedulerOutput(
            requests=[request for request, _ in kept],
            num_scheduled_tokens=[count for _, count in kept],
            preempted=self.preempted,
        )


class Scheduler:
    """Keeps the waiting and running queues, each ordered by (priority, arrival)."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.speculative_config = speculative_config
        self.proposer = None if speculative_config is None else NgramProposer(speculative_config)
        self.spec_decoding = SpecDecodingCounts()
        # Called once for every request that leaves the engine (the LoRA slot refcount).
        self.on_finish: Callable[[Request], None] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def schedule(self) -> SchedulerOutput:
        """Running requests first, in (priority, arrival) order, then waiting ones.

        One exception for priority classes: waiting requests of a better class are admitted
        before running requests of a worse one, so a batch prefill cannot spend the budget
        that a newly arrived interactive request needs.
        """
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._preempt_for_better_class(output)
        num_preempted_for_class = len(output.preempted)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if (
                self.waiting
                and self.waiting[0].priority < request.priority
                and len(output.preempted) == num_preempted_for_class
            ):
                num_running = len(self.running)
                budget = self._admit(output, budget, priority_limit=request.priority)
                index += len(self.running) - num_running  # admitted ones sort ahead of request
                if budget == 0:
                    break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            request.spec_token_ids = self._drafts(request, num_new, budget)
            # A draft never preempts: without blocks for it, the request runs without drafts.
            if request.spec_token_ids and self.kv_cache_manager.allocate_slots(
                request, num_new + len(request.spec_token_ids)
            ):
                num_new += len(request.spec_token_ids)
            else:
                request.spec_token_ids = []
                if not self._make_room(request, num_new, output):
                    break  # the request preempted itself: it was the last one running
            output.requests.append(request)
            output.num_scheduled_tokens.append(num_new)
            budget -= num_new
            index += 1

        # Admitting new work in a step that ran short of blocks would only thrash the cache.
        if len(output.preempted) == num_preempted_for_class:
            self._admit(output, budget)
        return output

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Draft tokens for a decoding request, within the budget left and its length limits."""
        config = self.speculative_config
        if (
            self.proposer is None
            or config is None
            or num_new != 1
            or request.num_tokens - request.num_computed_tokens != 1
            or not request.can_speculate
            or (
                config.disable_by_batch_size is not None
                and len(self.running) >= config.disable_by_batch_size
            )
        ):
            return []
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return []  # EOS is banned per step until min_tokens; drafts would skip the ban
        # A step adds the accepted drafts and one token more; none may pass the limits.
        max_drafts = min(budget - 1, self.max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            max_drafts = min(max_drafts, params.max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request.all_token_ids, max_drafts)

    def _admit(
        self, output: SchedulerOutput, budget: int, priority_limit: float = float("inf")
    ) -> int:
        """Move waiting requests of priority below ``priority_limit`` to running while seats,
        blocks and budget last; returns the budget left."""
        while (
            self.waiting
            and self.waiting[0].priority < priority_limit
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            # Waiting requests (new or preempted) have nothing computed; cached blocks count.
            computed_blocks = self.kv_cache_manager.get_computed_blocks(request)
            num_cached = len(computed_blocks) * self.kv_cache_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks):
                break
            request.num_computed_tokens = num_cached
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            output.requests.append(request)
            output.num_scheduled_tokens.append(num_new)
            budget -= num_new
        return budget

    def _preempt_for_better_class(self, output: SchedulerOutput) -> None:
        """Give the seat and blocks of the worst running request to a waiting one of a better class.

        Without this, batch requests that fill ``max_num_seqs`` or the KV pool would keep a newly
        arrived interactive request waiting until they finish. Runs before anything is scheduled,
        so victims have no tokens in this step. Cache hits are not counted in the blocks the
        waiting request needs: at worst a batch request too many is preempted, and its blocks
        stay cached for its return.
        """
        manager = self.kv_cache_manager
        while self.waiting and self.running:
            head, worst = self.waiting[0], self.running[-1]
            if worst.priority <= head.priority:
                return
            first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
            if (
                len(self.running) < self.max_num_seqs
                and manager.blocks_needed(first_chunk) <= manager.num_free_blocks
            ):
                return
            self.running.pop()
            self._preempt(worst)
            output.preempted.append(worst)

    def _make_room(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Allocate slots for ``request``, preempting the lowest-priority, newest runners if needed.

        The running list is sorted, so victims come from its tail, which this step has not
        scheduled yet. Returns False when ``request`` itself had to be preempted.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, queue again at its priority."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        deferred: frozenset[str] = frozenset(),
    ) -> list[tuple[Request, int]]:
        """Advance counters, append sampled tokens, finish what hit a stop; return what changed,
        each request with the number of tokens it gained.

        A request that carried ``k`` drafts and got ``a + 1`` tokens had ``a`` drafts accepted:
        only those count as computed. The K/V its rejected drafts wrote stays in its slots until
        real tokens overwrite it (as in vLLM V1). Tokens are checked for stops in order, and the
        request ends at the first one, without the tokens after it.

        A ``deferred`` request (its grammar mask was not ready) sampled nothing although its
        last token ran: that token counts as not computed, so the next step runs it again (the
        same K/V into the same slot) and samples then. It keeps its blocks; nothing else changes.
        """
        changed = []
        for request, num_scheduled in zip(
            output.requests, output.num_scheduled_tokens, strict=True
        ):
            num_drafts = len(request.spec_token_ids)
            request.spec_token_ids = []
            if request.request_id in deferred:
                request.num_computed_tokens += num_scheduled - num_drafts - 1
                continue
            token_ids = sampled_token_ids.get(request.request_id)
            if token_ids is None:
                request.num_computed_tokens += num_scheduled
                continue  # a prompt chunk that is not the last one: nothing sampled yet
            num_accepted = len(token_ids) - 1
            request.num_computed_tokens += num_scheduled - (num_drafts - num_accepted)
            if num_drafts:
                self.spec_decoding.num_drafts += 1
                self.spec_decoding.num_draft_tokens += num_drafts
                self.spec_decoding.num_accepted_tokens += num_accepted
            num_appended = 0
            for token_id in token_ids:
                request.append_output_token(token_id)
                num_appended += 1
                status = self._check_stop(request, token_id)
                if status is not None:
                    self.finish_request(request, status)
                    break
            changed.append((request, num_appended))
        return changed

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_set:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from whichever queue holds it and give back its blocks."""
        if request.status.finished:
            return
        queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if self.on_finish is not None:
            self.on_finish(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request
