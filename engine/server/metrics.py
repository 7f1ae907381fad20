"""The Prometheus metrics of an engine pod: vLLM's set, one to one, under the prefix ``llmpool:``.

Three load gauges are also exported under vLLM's own names (``vllm:``), with the same values: the
model-server protocol of the Gateway API Inference Extension reads them, so llm-d's router or any
InferencePool implementation can front a pool as well as our gateway does. With LoRA on,
``vllm:lora_requests_info`` joins them: those routers read it to send a request for an adapter to
a replica that has it running (see :class:`LoraMetrics`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from llmpool.engine.engine_core import EngineStats
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.server.async_engine import StepObserver
from llmpool.engine.structured_outputs import GrammarBudget
from llmpool.prometheus import Series

FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets, so that dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
# The gauges routers read by vLLM's names (see the module docstring).
INTEROP_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Compiles are cached per spec: hits take microseconds, a large schema tens of milliseconds.
GRAMMAR_COMPILE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# A schema's mask takes ~0.05 ms; an ambiguous grammar's, tenths of a second and up.
GRAMMAR_MASK_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
# The engine's counters that EngineStats carries as running totals; Prometheus takes increments.
CUMULATIVE_STATS = (
    ("num_preemptions", "num_preemptions"),
    ("prefix_cache_queries", "prefix_cache_queries"),
    ("prefix_cache_hits", "prefix_cache_hits"),
    ("grammar_mask_seconds", "grammar_mask_time"),
    ("grammar_wait_seconds", "grammar_wait_time"),
    ("grammar_steps", "grammar_steps"),
    ("grammar_rows_deferred", "grammar_rows_deferred"),
    ("grammar_budget_exceeded", "grammar_budget_exceeded"),
    ("spec_decode_num_drafts", "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens"),
)


def _no_stats() -> EngineStats:
    return EngineStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=0, num_total_blocks=0,
        num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
    )  # fmt: skip


@dataclass
class Totals:
    """What the periodic stats line turns into rates: the tokens counted as they stream, and the
    engine's last stats (whose counters are running totals)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    engine: EngineStats = field(default_factory=_no_stats)


class EngineMetrics(StepObserver):
    """Updated from the engine thread as steps complete; ``render()`` serves ``GET /metrics``."""

    def __init__(self, model_name: str, max_loras: int | None = None) -> None:
        """``max_loras``: the engine's LoRA slots; None when LoRA is off (no LoRA metrics)."""
        self.series = Series("llmpool", ["model_name"])
        self._model = {"model_name": model_name}
        self._interop: dict[str, Gauge] = {}
        self._load_series()
        self._latency_series()
        self._counter_series()
        self._grammar_series()
        # Every series exists from the start, so that rate() and absent() work on a fresh pod.
        for metric in (
            self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
            self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
            self.request_queue_time, self.num_preemptions, self.prompt_tokens,
            self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
            self.grammar_mask_time, self.grammar_wait_time, self.grammar_steps,
            self.grammar_mask_step_time, self.grammar_rows_deferred, self.grammar_budget_exceeded,
            self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens, *self._interop.values(),
        ):  # fmt: skip
            metric.labels(**self._model)
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason, **self._model)
        self.totals = Totals()
        self._totals_lock = threading.Lock()
        self.lora = None if max_loras is None else LoraMetrics(self.series, model_name, max_loras)

    def _gauge(self, name: str, doc: str) -> Gauge:
        """A load gauge, and its twin under vLLM's name for the routers that read those."""
        if name in INTEROP_GAUGES:
            self._interop[name] = self.series.gauge(name, doc, prefix="vllm")
        return self.series.gauge(name, doc)

    def _load_series(self) -> None:
        self.num_requests_running = self._gauge(
            "num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage_perc = self._gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1.0 is full)."
        )

    def _latency_series(self) -> None:
        histogram = self.series.histogram
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From arrival to the first output token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between consecutive output tokens.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "From arrival to first scheduling.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip

    def _counter_series(self) -> None:
        counter = self.series.counter
        self.num_preemptions = counter("num_preemptions", "Preemptions (KV freed for recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests prefilled.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: request steps that carried drafts."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (rate: over draft tokens).",
        )

    def _grammar_series(self) -> None:
        counter = self.series.counter
        self.structured_output_requests = counter(
            "structured_output_requests",
            "Requests with an output grammar, by kind (json_schema, json_object, regex, choice,"
            " grammar, tool_call).",
            ("kind",),
        )
        self.grammar_compile_time = self.series.histogram(
            "grammar_compile_seconds",
            "Compiling a request's output grammar (a cached grammar takes microseconds).",
            GRAMMAR_COMPILE_BUCKETS,
            ("kind",),
        )
        self.grammar_mask_time = counter(
            "grammar_mask_seconds",
            "Computing structured-output token masks, beside the forward passes.",
        )
        self.grammar_wait_time = counter(
            "grammar_wait_seconds",
            "Of the mask time, what steps waited for after their forward pass.",
        )
        self.grammar_steps = counter(
            "grammar_steps", "Steps that computed structured-output masks."
        )
        self.grammar_mask_step_time = self.series.histogram(
            "grammar_mask_step_seconds",
            "One request's structured-output mask for one token.",
            GRAMMAR_MASK_BUCKETS,
        )
        self.grammar_budget = self.series.gauge(
            "grammar_budget",
            "The engine's grammar budgets: step_seconds (--grammar-step-budget-ms),"
            " request_seconds (--grammar-request-budget-s), compile_fuel (--grammar-compile-fuel).",
            ("limit",),
        )
        self.grammar_rows_deferred = counter(
            "grammar_rows_deferred",
            "Rows that skipped a step: their mask was not ready within --grammar-step-budget-ms.",
        )
        self.grammar_budget_exceeded = counter(
            "grammar_budget_exceeded",
            "Requests ended with 400 grammar_budget_exceeded: their grammar spent"
            " --grammar-request-budget-s of mask time, or was refused mid-generation.",
        )

    def render(self) -> bytes:
        return self.series.render()

    # --- StepObserver (engine thread) ---------------------------------------------------------

    def on_scheduled(self, queue_time: float) -> None:
        self.request_queue_time.labels(**self._model).observe(queue_time)

    def on_tokens(
        self, delta: RequestDelta, first: bool, latency: float, lora_name: str | None = None
    ) -> None:
        num_tokens = len(delta.new_token_ids)
        if lora_name is not None and self.lora is not None:
            self.lora.on_tokens(lora_name, delta.num_prompt_tokens if first else 0, num_tokens)
        if first:
            self.time_to_first_token.labels(**self._model).observe(latency)
            self.prompt_tokens.labels(**self._model).inc(delta.num_prompt_tokens)
        else:
            self.inter_token_latency.labels(**self._model).observe(latency)
        self.generation_tokens.labels(**self._model).inc(num_tokens)
        with self._totals_lock:
            self.totals.generation_tokens += num_tokens
            if first:
                self.totals.prompt_tokens += delta.num_prompt_tokens

    def on_finished(
        self, finish_reason: str, e2e_latency: float, lora_name: str | None = None
    ) -> None:
        if lora_name is not None and self.lora is not None:
            self.lora.requests.labels(lora_name=lora_name, **self._model).inc()
        self.e2e_request_latency.labels(**self._model).observe(e2e_latency)
        self.request_success.labels(finished_reason=finish_reason, **self._model).inc()

    def on_stats(self, stats: EngineStats) -> None:
        for name, value in (
            ("num_requests_running", stats.num_running),
            ("num_requests_waiting", stats.num_waiting),
            ("kv_cache_usage_perc", stats.kv_cache_usage),
        ):
            getattr(self, name).labels(**self._model).set(value)
            self._interop[name].labels(**self._model).set(value)
        if self.lora is not None:
            self.lora.on_adapters(stats.running_adapters, stats.waiting_adapters)
        with self._totals_lock:
            self._count_increments(self.totals.engine, stats)
            self.totals.engine = stats

    def set_grammar_budget(self, budget: GrammarBudget) -> None:
        """The engine's grammar budgets (its --grammar-* flags), exported as gauges."""
        self.grammar_budget.labels(limit="step_seconds", **self._model).set(budget.step_seconds)
        self.grammar_budget.labels(limit="request_seconds", **self._model).set(
            budget.request_seconds
        )
        self.grammar_budget.labels(limit="compile_fuel", **self._model).set(budget.compile_fuel)

    def on_grammar_mask(self, seconds: float) -> None:
        """Called by the engine's mask workers, once per request and token."""
        self.grammar_mask_step_time.labels(**self._model).observe(seconds)

    def on_grammar_compiled(self, kind: str, seconds: float, cache_hit: bool) -> None:
        """Called by the engine's StructuredOutputManager, once per request with a grammar."""
        self.structured_output_requests.labels(kind=kind, **self._model).inc()
        self.grammar_compile_time.labels(kind=kind, **self._model).observe(seconds)

    def _count_increments(self, previous: EngineStats, stats: EngineStats) -> None:
        """The engine counts these as running totals; Prometheus counters take the increments."""
        for name, attribute in CUMULATIVE_STATS:
            increment = getattr(stats, name) - getattr(previous, name)
            if increment > 0:
                getattr(self, attribute).labels(**self._model).inc(increment)

    def snapshot(self) -> Totals:
        with self._totals_lock:
            return Totals(**vars(self.totals))


class LoraMetrics:
    """The LoRA series, present only when LoRA is on.

    ``lora_requests_info`` is vLLM's: one series whose labels name the adapters of the running
    and of the waiting requests (sorted, comma-joined) beside ``max_lora``, and whose value is
    the time they last changed; it is exported under both prefixes, like the load gauges. The
    per-adapter counters are ours.
    """

    def __init__(self, series: Series, model_name: str, max_loras: int) -> None:
        """``series``: the engine's, labelled with ``model_name`` first."""
        labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        doc = "Adapters of the running and waiting requests; the value is when they last changed."
        self.info = [
            series.gauge("lora_requests_info", doc, labels, prefix=prefix)
            for prefix in ("vllm", "llmpool")
        ]

        def counter(name: str, doc: str) -> Counter:
            return series.counter(name, doc, ["lora_name"])

        self.requests = counter("lora_requests", "Finished requests, per LoRA adapter.")
        self.prompt_tokens = counter(
            "lora_prompt_tokens", "Prompt tokens of the requests prefilled, per LoRA adapter."
        )
        self.generation_tokens = counter(
            "lora_generation_tokens", "Output tokens generated, per LoRA adapter."
        )
        self._model_name = model_name
        self._max_loras = str(max_loras)
        self._info_labels: tuple[str, ...] | None = None
        self.on_adapters((), ())

    def on_tokens(self, lora_name: str, prompt_tokens: int, generation_tokens: int) -> None:
        labels = {"model_name": self._model_name, "lora_name": lora_name}
        if prompt_tokens:
            self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(generation_tokens)

    def on_adapters(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        """Replace the one info series when the adapters change (the new one is set before the
        old one goes, so that a scrape never finds none)."""
        labels = (
            self._model_name,
            self._max_loras,
            ",".join(sorted(running)),
            ",".join(sorted(waiting)),
        )
        if labels == self._info_labels:
            return
        now = time.time()
        for gauge in self.info:
            gauge.labels(*labels).set(now)
            if self._info_labels is not None:
                gauge.remove(*self._info_labels)
        self._info_labels = labels
