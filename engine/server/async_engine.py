"""AsyncEngine: runs EngineCore.step() in its own thread and streams each request's deltas to asyncio.

The engine core is synchronous and not thread-safe, so only the engine thread touches it. The
event loop talks to that thread through one command queue (add, abort, call: a function run
between steps) and hears back through an outbox: each step appends its deltas, and only a step that finds the outbox empty wakes the
loop (``loop.call_soon_threadsafe``), so the loop is woken at most once per step however many
requests a step serves, and a loop that falls behind takes several steps' deltas in one turn. A
request with ``n`` choices (or several prompts) is a group of child requests in the engine,
merged into one stream of ``(index, delta)``.

Only the engine thread runs torch once the server is up: the warm-up runs there too, before its
loop (``start(prepare=...)``), and ``llmpool serve`` builds the core in a thread that has ended
before this one starts. GNU OpenMP keeps a team of worker threads per thread that ever ran a
parallel region, and once the process holds more OpenMP threads than CPUs, every worker sleeps
between regions instead of spinning; a decode step runs hundreds of small parallel regions, so a
second team (a core built on the main thread, a warm-up in an executor thread) cost 2x per token
on 2 cores (``benchmarks/server_overhead.py``).

Both threads share the GIL: whatever Python the loop runs per token stalls the engine thread
at its next Python line (a forward releases the GIL only inside torch ops), so the engine
thread does per step only what must happen there (timings for metrics, one stats update), and
the loop's per-token work is kept small (see ``responses.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmpool.engine.engine_core import EngineCore, EngineStats
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.request import RequestStatus
from llmpool.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps on the command queue before checking for shutdown.
_IDLE_POLL_SECONDS = 0.5
# How often a drain looks whether the requests in flight have finished.
_DRAIN_POLL_SECONDS = 0.1

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queue`` allows; the server answers 429."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or failed; the server answers 503."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (its other children are aborted); the loop goes on.

    ``code`` is set when the request's own input failed it (``grammar_budget_exceeded``): the
    server answers 400 rather than 500."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ChildRequest:
    """One sequence of a request group: the engine's unit of work."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int | None = None  # None: the engine's priority class
    cache_salt: str | None = None
    lora_name: str | None = None  # a loaded LoRA adapter; None: the base model


@dataclass
class _RequestTiming:
    arrival_time: float
    lora_name: str | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None


class StepObserver:
    """What the engine thread reports per request and per step (the metrics implement it)."""

    def on_scheduled(self, queue_time: float) -> None: ...
    def on_tokens(
        self, delta: RequestDelta, first: bool, latency: float, lora_name: str | None = None
    ) -> None: ...
    def on_finished(
        self, finish_reason: str, e2e_latency: float, lora_name: str | None = None
    ) -> None: ...
    def on_stats(self, stats: EngineStats) -> None: ...


@dataclass
class _AddGroup:
    child_ids: list[str]
    children: list[ChildRequest]
    arrival_time: float
    accepted: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    child_ids: list[str]


@dataclass
class _Call:
    """A function the engine thread runs between steps (e.g. installing a LoRA adapter)."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


_StreamItem = tuple[int, RequestDelta] | BaseException


class RequestStream:
    """The merged deltas of one request group; ``abort()`` (idempotent) frees its engine work."""

    def __init__(self, engine: AsyncEngine, child_ids: list[str]) -> None:
        self._engine = engine
        self.child_ids = child_ids
        self._unfinished = set(range(len(child_ids)))
        self._items: deque[_StreamItem] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def _put(self, item: _StreamItem) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next(self) -> _StreamItem:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        while self._unfinished:
            item = await self._next()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            index, delta = item
            if delta.finished:
                self._unfinished.discard(index)
            if delta.error is not None:
                # The caller's abort() then ends the sibling children still in the engine.
                raise RequestFailedError(delta.error, delta.error_code)
            yield index, delta

    def abort(self) -> None:
        if self._unfinished:
            self._engine._abort([self.child_ids[i] for i in self._unfinished])
            self._unfinished.clear()


class AsyncEngine:
    """Owns the engine thread; ``submit()`` returns a stream once the engine accepted the request."""

    def __init__(
        self, core: EngineCore, max_queue: int, observer: StepObserver | None = None
    ) -> None:
        self.core = core
        self.max_queue = max_queue
        self.observer = observer or StepObserver()
        self._commands: queue.SimpleQueue[_AddGroup | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        # Deltas the engine thread handed over and the loop has not dispatched yet.
        self._outbox: list[RequestDelta] = []
        self._outbox_lock = threading.Lock()
        self._timings: dict[str, _RequestTiming] = {}  # engine thread only
        # Children submitted but not yet scheduled once: the queue that admission control bounds.
        self._unscheduled: set[str] = set()
        self._unscheduled_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self.error: BaseException | None = None

    # --- lifecycle (event loop) --------------------------------------------------------------

    async def start(self, prepare: Callable[[], None] | None = None) -> None:
        """Start the engine thread; ``prepare`` (the warm-up) runs first in that thread.

        Returns once ``prepare`` has run, and raises what it raised (the thread then ends).
        """
        self._loop = asyncio.get_running_loop()
        prepared: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(prepare, prepared), name="engine-loop", daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(prepared)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def accepting(self) -> bool:
        """Running and not draining: new requests are taken."""
        return self.running and not self._draining

    @property
    def num_open_requests(self) -> int:
        """Request groups submitted whose stream has not ended yet."""
        return len({id(stream) for stream, _ in self._streams.values()})

    async def drain(self, timeout: float) -> int:
        """Refuse new requests from now on and wait up to ``timeout`` seconds for the open ones
        to finish; returns how many are still open (``shutdown`` then ends them)."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._streams and self.running and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_SECONDS)
        return self.num_open_requests

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight end with EngineStoppedError."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineStoppedError("the server is shutting down"))

    @property
    def num_unscheduled(self) -> int:
        with self._unscheduled_lock:
            return len(self._unscheduled)

    # --- requests (event loop) ---------------------------------------------------------------

    async def submit(
        self, request_id: str, children: list[ChildRequest], arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a request group; raises what the engine raised (e.g. PromptTooLongError).

        Returns once the engine thread has added every child, at most one step later.
        """
        if self._draining and self.running:
            raise EngineStoppedError("this replica is shutting down; retry on another")
        if not self.running:
            raise EngineStoppedError(
                "the engine is not running" + (f": {self.error}" if self.error else "")
            )
        child_ids = [f"{request_id}-{index}" for index in range(len(children))]
        with self._unscheduled_lock:
            if len(self._unscheduled) + len(children) > self.max_queue:
                raise QueueFullError(
                    f"{len(self._unscheduled)} requests are waiting and the queue holds {self.max_queue}"
                )
            self._unscheduled.update(child_ids)
        stream = RequestStream(self, child_ids)
        for index, child_id in enumerate(child_ids):
            self._streams[child_id] = (stream, index)
        command = _AddGroup(child_ids, children, arrival_time or time.monotonic())
        self._commands.put(command)
        try:
            await asyncio.wrap_future(command.accepted)
        except BaseException:
            # Rejected, or the caller went away while waiting: either way nothing may stay queued.
            self._forget(child_ids)
            accepted = command.accepted
            rejected = accepted.done() and not accepted.cancelled() and accepted.exception()
            if not rejected:
                self._commands.put(_Abort(child_ids))
            raise
        return stream

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps and return what it returned (or
        raise what it raised): the way to change engine state that a step reads."""
        if not self.running:
            raise EngineStoppedError(
                "the engine is not running" + (f": {self.error}" if self.error else "")
            )
        command = _Call(fn)
        self._commands.put(command)
        result: T = await asyncio.wrap_future(command.done)
        return result

    def _abort(self, child_ids: list[str]) -> None:
        self._forget(child_ids)
        self._commands.put(_Abort(child_ids))

    def _forget(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            self._streams.pop(child_id, None)
        with self._unscheduled_lock:
            self._unscheduled.difference_update(child_ids)

    def _drain_outbox(self) -> None:
        with self._outbox_lock:
            deltas, self._outbox = self._outbox, []
        for delta in deltas:
            entry = self._streams.get(delta.request_id)
            if entry is None:
                continue  # aborted by its client after this step began
            stream, index = entry
            if delta.finished:
                del self._streams[delta.request_id]
            stream._put((index, delta))

    def _fail_all(self, error: BaseException) -> None:
        streams = {stream for stream, _ in self._streams.values()}
        self._streams.clear()
        for stream in streams:
            stream._put(error)

    # --- the engine thread -------------------------------------------------------------------

    def _run(
        self, prepare: Callable[[], None] | None, prepared: concurrent.futures.Future[None]
    ) -> None:
        try:
            if prepare is not None:
                prepare()
        except BaseException as error:
            self._stopping = True
            prepared.set_exception(error)
            return
        prepared.set_result(None)
        try:
            while not self._stopping:
                self._apply_commands(block=not self.core.has_unfinished_requests())
                if self._stopping or not self.core.has_unfinished_requests():
                    continue
                self._step()
        except BaseException as error:  # a bug in the engine: fail loudly, never hang clients
            logger.exception("the engine loop failed; failing all requests")
            self.error = error
            self._stopping = True
            self._call_soon(
                self._fail_all, EngineStoppedError(f"the engine loop failed: {error!r}")
            )
        finally:
            self._abort_everything()
            self._reject_pending_adds()

    def _apply_commands(self, block: bool) -> None:
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=_IDLE_POLL_SECONDS))
            except queue.Empty:
                return
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, _AddGroup):
                self._add_group(command)
            elif isinstance(command, _Abort):
                self._abort_in_engine(command.child_ids)
            elif isinstance(command, _Call):
                self._run_call(command)
        if commands:
            self.observer.on_stats(self.core.stats())

    def _add_group(self, command: _AddGroup) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller went away before the engine saw the request
        added = []
        try:
            for child_id, child in zip(command.child_ids, command.children, strict=True):
                self.core.add_request(
                    child_id,
                    child.prompt_token_ids,
                    child.sampling_params,
                    command.arrival_time,
                    priority=child.priority,
                    cache_salt=child.cache_salt,
                    lora_name=child.lora_name,
                )
                self._timings[child_id] = _RequestTiming(command.arrival_time, child.lora_name)
                added.append(child_id)
        except Exception as error:
            self._abort_in_engine(added, record=False)
            command.accepted.set_exception(error)
            return
        command.accepted.set_result(None)

    @staticmethod
    def _run_call(command: _Call) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the caller went away first
        try:
            command.done.set_result(command.fn())
        except Exception as error:
            command.done.set_exception(error)

    def _abort_in_engine(self, child_ids: list[str], record: bool = True) -> None:
        now = time.monotonic()
        self.core.abort_requests(child_ids)
        for child_id in child_ids:
            timing = self._timings.pop(child_id, None)
            if timing is not None and record:
                self.observer.on_finished(
                    RequestStatus.FINISHED_ABORTED.value,
                    now - timing.arrival_time,
                    timing.lora_name,
                )

    def _step(self) -> None:
        started = time.monotonic()
        deltas = self.core.step()
        now = time.monotonic()
        self._note_first_scheduled(started)
        for delta in deltas:
            timing = self._timings.get(delta.request_id)
            if timing is None:
                continue
            first = timing.last_token_time is None
            since = timing.arrival_time if first else timing.last_token_time
            self.observer.on_tokens(delta, first, now - since, timing.lora_name)
            timing.last_token_time = now
            if delta.finished:
                del self._timings[delta.request_id]
                self.observer.on_finished(
                    delta.finish_reason or "", now - timing.arrival_time, timing.lora_name
                )
        self.observer.on_stats(self.core.stats())
        if deltas:
            self._hand_off(deltas)

    def _hand_off(self, deltas: list[RequestDelta]) -> None:
        """Give a step's deltas to the loop; wake it only if it has nothing left to dispatch."""
        with self._outbox_lock:
            wake = not self._outbox
            self._outbox.extend(deltas)
        if wake:
            self._call_soon(self._drain_outbox)

    def _note_first_scheduled(self, step_started: float) -> None:
        """Queue time ends when a child first leaves the waiting queue (read after the step)."""
        if not self._unscheduled:  # the usual decode step: nobody waits for a first schedule
            return
        with self._unscheduled_lock:
            pending = list(self._unscheduled)
        requests = self.core.scheduler.requests
        scheduled = []
        for child_id in pending:
            request = requests.get(child_id)
            timing = self._timings.get(child_id)
            if timing is None or (request is not None and request.status == RequestStatus.WAITING):
                continue  # not added yet, or still waiting
            timing.first_scheduled_time = step_started
            self.observer.on_scheduled(step_started - timing.arrival_time)
            scheduled.append(child_id)
        with self._unscheduled_lock:
            self._unscheduled.difference_update(scheduled)

    def _abort_everything(self) -> None:
        unfinished = list(self._timings)
        if unfinished:
            self._abort_in_engine(unfinished)
            self.observer.on_stats(self.core.stats())

    def _reject_pending_adds(self) -> None:
        """Requests that reached the queue after the loop's last turn must not wait forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            stopped = EngineStoppedError("the server is shutting down")
            if isinstance(command, _AddGroup) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(stopped)
            elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(stopped)

    def _call_soon(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)
