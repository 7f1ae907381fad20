"""ModelRunner: turns a SchedulerOutput into flat tensors, runs one forward and samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from llmpool.engine.attention import AttentionMetadata
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.models.llama import LlamaForCausalLM
from llmpool.engine.request import Request
from llmpool.engine.sampler import Sampler, SamplerOutput
from llmpool.engine.scheduler import SchedulerOutput


@dataclass
class StepTimings:
    """Seconds spent in each phase of the steps so far (what `llmpool bench` reports)."""

    schedule: float = 0.0
    prepare_inputs: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled
    sampling_requests: list[Request] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache_manager: KVCacheManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.device = device
        self.sampler = Sampler()
        self.timings = StepTimings()

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
                for token in r.all_token_ids[start : start + count]
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
        # A request samples when this step brings its computed tokens up to all its tokens.
        samples = seq_lens == np.array([r.num_tokens for r in requests])
        logits_indices = query_start_loc[1:][samples] - 1

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
        )

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> tuple[list[Request], SamplerOutput]:
        """One forward over the step's tokens; returns the requests that sampled and their tokens."""
        started = time.perf_counter()
        inputs = self.prepare_inputs(scheduled)
        prepared = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices)).cpu()
        forwarded = time.perf_counter()
        sampled = (
            self.sampler(logits, inputs.sampling_requests)
            if inputs.sampling_requests
            else SamplerOutput(token_ids=[], logprobs=[])
        )
        finished = time.perf_counter()
        self.timings.prepare_inputs += prepared - started
        self.timings.forward += forwarded - prepared
        self.timings.sample += finished - forwarded
        self.timings.steps += 1
        return inputs.sampling_requests, sampled
