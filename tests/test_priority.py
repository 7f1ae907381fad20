"""Priority classes: interactive work runs first, batch work is preempted first and never stalls it."""

from __future__ import annotations

import zlib

import pytest

from llmpool.engine.config import EngineConfig
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.request import Request
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.scheduler import Scheduler, SchedulerOutput
from llmpool.protocol.priority import PRIORITY_CLASSES

INTERACTIVE = PRIORITY_CLASSES["interactive"]
BATCH = PRIORITY_CLASSES["batch"]


def make_request(
    request_id: str, prompt_len: int, priority: int, arrival: float, max_tokens: int = 64
) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Distinct tokens per request: these tests are about order, not about cache hits.
    prompt = [zlib.crc32(request_id.encode()) % 1000 + i for i in range(prompt_len)]
    return Request(request_id, prompt, params, frozenset(), arrival_time=arrival, priority=priority)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with fake sampling: every request whose tokens are all computed samples token 7."""
    output = scheduler.schedule()
    sampled = {
        r.request_id: [7]
        for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)
        if r.num_computed_tokens + n == r.num_tokens
    }
    scheduler.update_from_output(output, sampled)
    return output


def scheduled_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {
        r.request_id: n for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)
    }


def test_priority_classes_follow_vllm_convention() -> None:
    assert INTERACTIVE < BATCH
    assert EngineConfig(priority_class="batch").priority_class == "batch"
    with pytest.raises(ValueError, match="priority_class"):
        EngineConfig(priority_class="urgent")


def test_interactive_is_admitted_before_earlier_batch() -> None:
    scheduler = Scheduler(KVCacheManager(64, 16), 1, 256, 1024)
    scheduler.add_request(make_request("batch", 20, BATCH, arrival=0.0))
    scheduler.add_request(make_request("chat", 20, INTERACTIVE, arrival=1.0))
    assert scheduled_tokens(run_step(scheduler)) == {"chat": 20}


def test_interactive_takes_the_seat_of_a_running_batch_request() -> None:
    scheduler = Scheduler(KVCacheManager(64, 16), 1, 256, 1024)
    scheduler.add_request(make_request("batch", 20, BATCH, arrival=0.0))
    assert scheduled_tokens(run_step(scheduler)) == {"batch": 20}
    scheduler.add_request(make_request("chat", 20, INTERACTIVE, arrival=1.0))
    output = run_step(scheduler)
    assert [r.request_id for r in output.preempted] == ["batch"]
    assert scheduled_tokens(output) == {"chat": 20}


def test_batch_is_preempted_first_even_when_older() -> None:
    """Two requests outgrow a 6-block pool; the older batch request yields to the interactive one."""
    scheduler = Scheduler(KVCacheManager(6, 4), 4, 256, 24)
    scheduler.add_request(make_request("batch", 8, BATCH, arrival=0.0, max_tokens=12))
    scheduler.add_request(make_request("chat", 8, INTERACTIVE, arrival=1.0, max_tokens=12))
    preempted = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        preempted += [r.request_id for r in run_step(scheduler).preempted]
    assert preempted and set(preempted) == {"batch"}


@pytest.mark.parametrize("batch_arrives_first", [True, False])
def test_long_batch_prefill_never_stalls_interactive_decodes(batch_arrives_first: bool) -> None:
    """Each step: every interactive stream gets its token, the batch prefill at most one chunk."""
    budget = 512
    scheduler = Scheduler(KVCacheManager(1024, 16), 16, budget, 8192)
    batch_arrival = 0.0 if batch_arrives_first else 10.0
    scheduler.add_request(make_request("batch", 7500, BATCH, arrival=batch_arrival))
    for index in range(3):
        chat = make_request(f"chat-{index}", 30, INTERACTIVE, arrival=1.0 + index, max_tokens=100)
        scheduler.add_request(chat)
    batch = scheduler.requests["batch"]
    steps_with_batch = 0
    while batch.num_computed_tokens < batch.num_prompt_tokens:
        tokens = scheduled_tokens(run_step(scheduler))
        assert sum(tokens.values()) <= budget
        chats = {rid: n for rid, n in tokens.items() if rid.startswith("chat")}
        assert len(chats) == 3, "an interactive stream got no token this step"
        if all(scheduler.requests[rid].num_output_tokens > 1 for rid in chats):
            assert set(chats.values()) == {1}  # decoding: one token per step
        steps_with_batch += "batch" in tokens
        assert tokens.get("batch", 0) <= budget - len(chats)
    assert steps_with_batch >= 7500 // budget


def test_interactive_arriving_during_batch_prefill_is_admitted_next_step() -> None:
    """The running batch prefill would spend the whole budget; the interactive request goes first."""
    budget = 256
    scheduler = Scheduler(KVCacheManager(1024, 16), 16, budget, 8192)
    scheduler.add_request(make_request("batch", 4000, BATCH, arrival=0.0))
    assert scheduled_tokens(run_step(scheduler)) == {"batch": budget}
    scheduler.add_request(make_request("chat", 40, INTERACTIVE, arrival=1.0))
    assert scheduled_tokens(run_step(scheduler)) == {"chat": 40, "batch": budget - 40}
    assert scheduled_tokens(run_step(scheduler)) == {"chat": 1, "batch": budget - 1}
