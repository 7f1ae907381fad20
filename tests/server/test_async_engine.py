"""AsyncEngine over a scripted engine core: fan-out, admission, aborts and a failing loop."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from llmpool.engine.engine_core import EngineStats
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.request import RequestStatus
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.server.async_engine import (
    AsyncEngine,
    ChildRequest,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
)


@dataclass
class _Scripted:
    remaining: int
    status: RequestStatus = RequestStatus.WAITING


class ScriptedCore:
    """Runs ``max_num_seqs`` requests a step; each emits one token per step until max_tokens.

    A step sleeps briefly, as a forward pass releases the GIL, so the event loop keeps pace.
    """

    def __init__(
        self,
        max_num_seqs: int = 2,
        fail_on_step: int | None = None,
        fail_request: str | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.fail_on_step = fail_on_step
        self.fail_request = fail_request  # this request fails alone on its second step
        self.steps = 0
        self.scheduler = SimpleNamespace(requests={})
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt_token_ids, sampling_params, arrival_time, **options):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.scheduler.requests[request_id] = _Scripted(sampling_params.max_tokens)

    def abort_requests(self, request_ids):
        for request_id in request_ids:
            if self.scheduler.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.scheduler.requests)

    def step(self):
        time.sleep(0.001)
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("scripted failure")
        deltas = []
        for request_id, request in list(self.scheduler.requests.items())[: self.max_num_seqs]:
            if request_id == self.fail_request and request.status == RequestStatus.RUNNING:
                del self.scheduler.requests[request_id]
                deltas.append(
                    RequestDelta(
                        request_id,
                        [],
                        "",
                        finished=True,
                        finish_reason="error",
                        error="IndexError: scripted",
                    )  # fmt: skip
                )
                continue
            request.status = RequestStatus.RUNNING
            request.remaining -= 1
            finished = request.remaining == 0
            if finished:
                del self.scheduler.requests[request_id]
            deltas.append(
                RequestDelta(
                    request_id,
                    [7],
                    "x",
                    finished=finished,
                    finish_reason="length" if finished else None,
                )
            )
        return deltas

    def stats(self):
        running = min(len(self.scheduler.requests), self.max_num_seqs)
        waiting = len(self.scheduler.requests) - running
        return EngineStats(
            num_running=running, num_waiting=waiting, kv_cache_usage=0.0, num_free_blocks=1,
            num_total_blocks=1, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
        )  # fmt: skip


def children(count: int, max_tokens: int = 3) -> list[ChildRequest]:
    return [ChildRequest([1, 2, 3], SamplingParams(max_tokens=max_tokens)) for _ in range(count)]


async def started(core: ScriptedCore, max_queue: int = 100) -> AsyncEngine:
    engine = AsyncEngine(core, max_queue)  # type: ignore[arg-type]
    await engine.start()
    return engine


async def until_idle(core: ScriptedCore) -> None:
    """Wait (up to a second) for the engine thread to have dropped every request."""
    for _ in range(50):
        if not core.scheduler.requests:
            return
        await asyncio.sleep(0.02)


async def test_children_are_merged_into_one_stream() -> None:
    engine = await started(ScriptedCore(max_num_seqs=4))
    stream = await engine.submit("r", children(3))
    received = [(index, delta.finished) async for index, delta in stream]
    assert sorted(index for index, _ in received) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [finished for _, finished in received].count(True) == 3
    await engine.shutdown()


async def test_engine_errors_on_submit_reach_the_caller_and_leave_nothing_behind() -> None:
    core = ScriptedCore()
    engine = await started(core)
    with pytest.raises(ValueError, match="empty"):
        await engine.submit("r", [*children(1), ChildRequest([], SamplingParams())])
    assert core.scheduler.requests == {} and engine.num_unscheduled == 0
    await engine.shutdown()


async def test_requests_beyond_max_queue_are_refused() -> None:
    """One runs (until aborted), two wait (the queue is full), the fourth is refused."""
    engine = await started(ScriptedCore(max_num_seqs=1), max_queue=2)
    streams = [await engine.submit("running", children(1, max_tokens=10**9))]
    while engine.num_unscheduled:
        await asyncio.sleep(0.01)
    streams += [await engine.submit(f"waiting-{i}", children(1)) for i in range(2)]
    with pytest.raises(QueueFullError):
        await engine.submit("refused", children(1))
    for stream in streams:
        stream.abort()
    assert engine.num_unscheduled == 0
    await engine.shutdown()


async def test_abort_reaches_the_engine_and_stops_the_stream() -> None:
    core = ScriptedCore()
    engine = await started(core)
    stream = await engine.submit("r", children(2, max_tokens=10**9))
    async for _ in stream:
        break
    stream.abort()
    await until_idle(core)
    assert sorted(core.aborted) == ["r-0", "r-1"]
    await engine.shutdown()


async def test_a_failing_engine_loop_fails_its_requests_and_stops() -> None:
    engine = await started(ScriptedCore(fail_on_step=2))
    stream = await engine.submit("r", children(1, max_tokens=10))
    with pytest.raises(EngineStoppedError, match="scripted failure"):
        async for _ in stream:
            pass
    assert engine.error is not None and not engine.running
    with pytest.raises(EngineStoppedError):
        await engine.submit("again", children(1))
    await engine.shutdown()


async def test_a_request_failed_by_the_engine_ends_its_stream_and_aborts_its_siblings() -> None:
    core = ScriptedCore(max_num_seqs=4, fail_request="r-1")
    engine = await started(core)
    stream = await engine.submit("r", children(2, max_tokens=10**9))
    with pytest.raises(RequestFailedError, match="IndexError: scripted"):
        async for _ in stream:
            pass
    stream.abort()
    await until_idle(core)
    assert core.aborted == ["r-0"]
    assert engine.running and engine.error is None  # the loop goes on
    after = await engine.submit("after", children(1))
    assert [delta.finished async for _, delta in after][-1]
    await engine.shutdown()


class TextCore(ScriptedCore):
    """Emits token ``k`` with text ``"<k>"`` at a request's ``k``-th step, so order is visible."""

    def __init__(self, max_num_seqs: int) -> None:
        super().__init__(max_num_seqs)
        self.emitted: dict[str, int] = {}

    def step(self):
        deltas = super().step()
        for delta in deltas:
            if delta.new_token_ids:
                position = self.emitted.get(delta.request_id, 0)
                self.emitted[delta.request_id] = position + 1
                delta.new_token_ids, delta.new_text = [position], f"<{position}>"
        return deltas


async def test_a_lagging_loop_gets_every_token_in_order_with_one_wake_up() -> None:
    """Steps that end while the loop is busy are handed over together, nothing lost or reordered."""
    core = TextCore(max_num_seqs=4)
    engine = await started(core)
    wake_ups = 0
    drain = engine._drain_outbox

    def counting_drain() -> None:
        nonlocal wake_ups
        wake_ups += 1
        drain()

    engine._drain_outbox = counting_drain  # type: ignore[method-assign]
    stream = await engine.submit("r", children(2, max_tokens=40))
    time.sleep(0.2)  # blocks the loop while the engine thread runs ~40 steps of ~1 ms
    received: dict[int, list[RequestDelta]] = {0: [], 1: []}
    async for index, delta in stream:
        received[index].append(delta)
    for deltas in received.values():
        assert [d.new_token_ids for d in deltas] == [[k] for k in range(40)]
        assert "".join(d.new_text for d in deltas) == "".join(f"<{k}>" for k in range(40))
        assert [d.finished for d in deltas] == [False] * 39 + [True]
    assert wake_ups < core.steps  # the steps that ended during the block shared a wake-up
    await engine.shutdown()


async def test_prepare_runs_in_the_engine_thread_before_start_returns() -> None:
    ran_in: list[str] = []
    engine = AsyncEngine(ScriptedCore(), 10)  # type: ignore[arg-type]
    await engine.start(prepare=lambda: ran_in.append(threading.current_thread().name))
    assert ran_in == ["engine-loop"]
    assert engine.running
    await engine.shutdown()


async def test_a_failing_prepare_fails_start_and_leaves_no_engine_running() -> None:
    def prepare() -> None:
        raise RuntimeError("warm-up failed")

    engine = AsyncEngine(ScriptedCore(), 10)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="warm-up failed"):
        await engine.start(prepare=prepare)
    assert not engine.running
    with pytest.raises(EngineStoppedError):
        await engine.submit("r", children(1))


async def test_call_runs_on_the_engine_thread_between_steps_and_returns_or_raises() -> None:
    core = ScriptedCore()
    engine = await started(core)
    stream = await engine.submit("r", children(1, max_tokens=10**9))

    def where() -> tuple[str, int]:
        steps = core.steps
        time.sleep(0.01)  # no step may run meanwhile
        assert core.steps == steps
        return threading.current_thread().name, steps

    thread, steps = await engine.call(where)
    assert thread == "engine-loop" and steps > 0

    def fail() -> None:
        raise LookupError("no such adapter")

    with pytest.raises(LookupError, match="no such adapter"):
        await engine.call(fail)
    async for _ in stream:  # the loop went on stepping the running request
        break
    stream.abort()
    await engine.shutdown()
    with pytest.raises(EngineStoppedError):
        await engine.call(lambda: None)
