"""Compiling the decoder beside serving: the engine takes requests eager from the start, while a
thread compiles every step size (``compilation.compile_all_sizes``) on scratch KV caches and then
switches the model to the compiled decoder between two forwards.

So a replica with ``--compile`` is Ready as soon as an eager one, cache or no cache; what it pays
instead is the compile's CPU (and the GIL, while dynamo traces) beside its first requests. Where
the compile stands is in the log and in ``/fingerprint`` (``observed.compile.state``). A compile
that fails is logged and leaves the engine eager: the replica keeps serving what it served.

The serving thread and this one may run forwards at once: each plans its own step
(``attention/step.py`` keeps the step per thread), writes its own caches, and dynamo's frame hook
is per thread, so the serving thread's eager forwards are never traced.

Serving comes first. Left to the GIL, the two threads convoy: an eager step releases the GIL in
each of its ~1,000 ops and waits up to the switch interval (5 ms) to take it back from dynamo's
tracing, so steps ran 30-100x slower while the decoder compiled (1.5-3.9 s instead of 35 ms,
measured). So the compile thread runs under a profile hook that, while a step runs, parks it at
its next Python call until the step ends (``_ServingFirst``): it compiles whenever the engine is
idle, and under load in a quarter of the time, between steps.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from llmpool.engine import compilation
from llmpool.engine.compile_cache import CompileCache, CompileReport
from llmpool.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


# The compile's share of the engine thread's time while requests keep it stepping: after each
# step the engine sleeps a third of the step, and the compile runs meanwhile.
COMPILE_SHARE = 0.25


class _ServingFirst:
    """Parks the compile thread (at its next Python or C call) while a step runs, and hands it
    ``COMPILE_SHARE`` of the time between steps: back-to-back steps would starve it, since a
    woken thread waits a switch interval for the GIL and the next step has begun by then."""

    def __init__(self) -> None:
        self._stepping = False
        # Set by the compile thread when it parks; only the step clears it, so the step sees it
        # even when the compile thread has already woken.
        self._parked = False
        self._idle = threading.Event()
        self._idle.set()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._parked = False
        self._stepping = True
        self._idle.clear()
        started = time.monotonic()
        try:
            yield
        finally:
            self._stepping = False
            self._idle.set()
            if self._parked:
                time.sleep((time.monotonic() - started) * COMPILE_SHARE / (1 - COMPILE_SHARE))

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        """``sys.setprofile``'s hook, in the compile thread only."""
        if self._stepping:
            self._parked = True
            self._idle.wait()


class BackgroundCompile:
    """One compile of ``model``'s decoder for step sizes 1 to ``max_tokens``, in a daemon thread
    (a server stopping mid-compile does not wait for it), from ``cache``'s artifacts where it
    holds them, storing them there where it did not."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_tokens: int,
        cache: CompileCache | None,
    ) -> None:
        compilation.check_can_compile(model.cos_sin_cache.device)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.cache = cache
        # Loaded here, not in the thread: the report says hit or miss from the first request on.
        hit = cache is not None and cache.load()
        self.report = CompileReport(
            enabled=True,
            state="compiling",
            cache="off" if cache is None else "hit" if hit else "miss",
            key=None if cache is None else cache.key,
        )
        self.error: BaseException | None = None
        self._serving_first = _ServingFirst()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmpool-compile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Around each engine step while the compile runs: the compile thread waits for it."""
        return self._serving_first.step()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the compiled decoder is in use; raise what made the compile fail."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the decoder is still compiling after {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"compiling the decoder failed: {self.report.error}") from self.error

    def _run(self) -> None:
        started = time.monotonic()
        sys.setprofile(self._serving_first.profile)
        try:
            graphs = self._compile()
        except Exception as error:  # noqa: BLE001 - any failure leaves the engine eager
            self.error = error
            self.report.error = f"{type(error).__name__}: {error}"[:500]
            self.report.state = "failed"
            logger.exception("compiling the decoder failed; the engine stays eager")
        else:
            self.report.state = "compiled"
            logger.info(
                "compiled the decoder%s: %d graphs for 1..%d tokens in %.0f s; steps run it now",
                " from cache" if self.report.cache == "hit" else "", graphs, self.max_tokens,
                time.monotonic() - started,
            )  # fmt: skip
        finally:
            sys.setprofile(None)
            self.report.seconds = time.monotonic() - started
            self._done.set()

    def _compile(self) -> int:
        cache = self.cache
        hit = self.report.cache == "hit"
        if cache is None:
            source = "compile cache off"
        elif hit:
            source = f"from cached artifacts, key {cache.key} in {cache.root}"
        else:
            source = f"cold: no cached artifacts for key {cache.key} in {cache.root}"
        logger.info("compiling the decoder while serving eager (%s)", source)
        compiled, graphs = compilation.compile_all_sizes(
            self.model, self.kv_caches, self.block_size, self.max_tokens
        )
        if cache is not None and not hit:
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is not None:
                cache.save(artifacts[0])
        self.model.use_decoder(compiled)
        return graphs
