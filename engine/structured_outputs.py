"""Structured outputs: grammars compiled from a JSON schema, regex, choices or Lark text, and the
per-request matchers that turn them into token masks at sampling (llguidance).

llguidance was chosen over xgrammar, measured on SmolLM2's tokenizer (``benchmarks/grammar_libraries.py``):
it compiles a schema 3-20x faster (a request's tools are a new grammar per request, so compile
time is per request, not amortized), it has no up-front automaton whose size a schema can blow
up (its Earley parser and lexer run on fuel budgets, ``LIMITS``, so a compile and each mask step
are bounded), and it depends on nothing (xgrammar requires torch, transformers and triton). Its mask
step is slower (0.05 ms against 0.01 ms a token), which is small beside a decode step and
overlapped with the forward pass (``ModelRunner``).

Fuel bounds one mask step's work, not its time: an ambiguous Lark grammar's Earley sets grow
with the output, and each step stays under the item limit while taking 0.06 to 0.3 s (1 to 5 s
on a busy machine). So the cost is bounded per request instead (``GrammarBudget``): each
request's next mask is computed on a worker thread as soon as its last token is accepted; a
step waits for it at most ``step_seconds`` from when it started, and a row not ready by then
is deferred (it samples nothing this step; the other rows step on). A request whose masks
have taken ``request_seconds`` in all, or whose grammar llguidance refuses mid-generation
(its fuel or item limit), is ended with ``GrammarBudgetExceeded`` (a 400 from the server).

A compiled grammar is cached per spec as a pristine matcher; each request (each of ``n``
choices) starts from a deep copy of it (microseconds), so the engine thread never compiles
what the server compiled beforehand. A matcher lives on its ``Request``: it has consumed exactly
the request's output tokens, so preemption by recompute, prefix caching and streaming leave it
as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar's text; larger is refused
MAX_CHOICES = 1024
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# Threads computing masks: a pathological grammar holds one for its whole step (llguidance
# cannot be interrupted), so a second keeps the other grammars' masks coming.
MASK_WORKERS = 2
MASK_WORKER_NICENESS = 10  # added to the workers' nice value (benchmarks/grammar_isolation.py)


@dataclass(frozen=True)
class GrammarBudget:
    """What one request's grammar may cost (engine flags ``--grammar-*``; docs/architecture.md).

    ``compile_fuel``: llguidance's lexer fuel for a compile (1M is ~20 ms of regex analysis);
    more is refused with 400. ``step_seconds``: how long a step waits for a row's mask, counted
    from when its computation started (masks of ordinary schemas take 0.05 ms; llguidance's step
    fuel alone allows ~15 ms). ``request_seconds``: the mask time a request may spend in all
    (a 4,096-token JSON answer spends ~0.2 s).
    """

    compile_fuel: int = 1_000_000
    step_seconds: float = 0.02
    request_seconds: float = 5.0

    def limits(self) -> llguidance.LLParserLimits:
        """llguidance's fuel budgets: a compile (lexer fuel, grammar size) and each mask step
        (lexer fuel, Earley items); verbose errors would echo the schema into logs and responses."""
        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.compile_fuel,
            step_lexer_fuel=200_000,  # ~15 ms of lexing per mask step
            step_max_items=50_000,
            max_grammar_size=200_000,
            verbose_errors=False,
        )


# vLLM's JSON defaults: whitespace between tokens is allowed, as models write it.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True}


class GrammarError(ValueError):
    """A spec that cannot become a grammar: too large, invalid, or over the compile budget."""


class GrammarBudgetExceeded(RuntimeError):
    """A request's grammar spent its mask budget, or llguidance refused it mid-generation.

    The request alone is ended; the server answers 400 ``grammar_budget_exceeded`` (an error
    event on a stream)."""

    code = "grammar_budget_exceeded"


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``); set exactly one."""

    json: str | dict[str, Any] | None = None  # a JSON schema, as text or object
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: Sequence[str] | None = None  # one of these strings exactly
    grammar: str | None = None  # a Lark grammar, llguidance's dialect

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or"
                f" grammar; got {', '.join(given) or 'none'}"
            )

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(
            n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None
        )

    def spec_text(self) -> str:
        """The spec as one canonical text: the cache key's body, and what the size bound counts."""
        if self.json_object:
            return ""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec (not yet validated)."""
        kind = self.kind
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as error:
                    raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex or "")
        if kind == "choice":
            choices = list(self.choice or [])
            if not choices or len(choices) > MAX_CHOICES:
                raise GrammarError(f"choice takes 1 to {MAX_CHOICES} strings, got {len(choices)}")
            if not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choice takes non-empty strings")
            # Lark string literals take JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        return llguidance.LLMatcher.grammar_from_lark(self.grammar or "")


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and whether it is done."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        # The next token's mask, computing or computed (StructuredOutputManager.start_mask);
        # None once a token is accepted, until the next is asked for.
        self.next_mask: Future[np.ndarray] | None = None
        self.mask_started = 0.0  # perf_counter when next_mask was asked for
        self.mask_running_since: float | None = None  # when a worker began it
        self.mask_seconds = 0.0  # all this request's masks so far (the request budget)
        self.last_mask_seconds = 0.0

    def spent(self, now: float) -> float:
        """Mask seconds spent, the one in flight included (not its wait for a worker)."""
        running = self.mask_running_since
        return self.mask_seconds + (0.0 if running is None else now - running)

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; raises if the grammar did not allow it (a masking bug)."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")
        self.next_mask = None

    @property
    def is_complete(self) -> bool:
        """Nothing more can follow: the request ends here."""
        return self._matcher.is_stopped()


class StructuredOutputManager:
    """One per engine: the tokenizer as llguidance sees it, the grammar cache, and masks.

    ``compile`` may run on any thread (the server calls it off the event loop); ``matcher``,
    ``masks``, ``start_mask`` and ``collect`` run on the engine thread, the masks themselves on
    the manager's workers.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        budget: GrammarBudget | None = None,
    ) -> None:
        # The mask covers the model's logits (its vocabulary may be padded past the tokenizer's).
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=sorted(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()
        self.budget = budget or GrammarBudget()
        self._limits = self.budget.limits()
        # The workers run no torch op, so they never start a second OpenMP thread team (see
        # async_engine.py for why that matters on CPU); llguidance releases the GIL.
        self._workers = ThreadPoolExecutor(
            MASK_WORKERS, thread_name_prefix="grammar-masks", initializer=_yield_to_the_engine
        )
        # Called as (kind, seconds, cache_hit) after each compile; the server's metrics set it.
        self.on_compile: Callable[[str, float, bool], None] | None = None
        # Called (on a worker) with each mask's seconds; the server's metrics set it.
        self.on_mask: Callable[[float], None] | None = None

    def compile(self, params: StructuredOutputsParams, kind: str | None = None) -> None:
        """Compile and cache ``params``'s grammar, or raise GrammarError saying why.

        The server calls this once per request, off its event loop; ``kind`` names the request's
        kind in metrics (``json_schema``, ``tool_call``, ...; default ``params.kind``).
        """
        started = time.perf_counter()
        _, hit = self._pristine(params)
        if self.on_compile is not None:
            self.on_compile(kind or params.kind, time.perf_counter() - started, hit)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request, from the cached grammar (compiled now if absent)."""
        pristine, _ = self._pristine(params)
        return GrammarMatcher(pristine.deep_copy())

    def _pristine(self, params: StructuredOutputsParams) -> tuple[llguidance.LLMatcher, bool]:
        """The cached matcher for ``params`` (compiled on a miss), and whether it was cached."""
        text = params.spec_text()
        size = len(text.encode("utf-8"))
        if size > MAX_SPEC_BYTES:
            raise GrammarError(
                f"the {params.kind} spec has {size:,} bytes; at most {MAX_SPEC_BYTES:,} are accepted"
            )
        key = f"{params.kind}\0{text}"
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached, True
        try:
            grammar = params.grammar_text()
        except GrammarError:
            raise
        except ValueError as error:  # llguidance refusing a value, e.g. an integer over 64 bits
            raise GrammarError(f"the {params.kind} spec cannot be compiled: {error}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"the {params.kind} spec does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher, False

    def masks(self, matchers: Sequence[GrammarMatcher | None]) -> np.ndarray:
        """``[len(matchers), vocab_size]`` bool, True where a token is allowed; rows without a
        grammar allow everything.

        llguidance's batch fill releases the GIL, so the forward pass runs beside it; numpy, not
        torch, unpacks the bits, so the thread that calls this runs no OpenMP region.
        """
        rows = [(m.llguidance_matcher, row) for row, m in enumerate(matchers) if m is not None]
        words = (self._tokenizer.vocab_size + 31) // 32
        bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, words * 4, len(matchers))
        # Token t is bit t % 32 of word t // 32: little-endian bytes, little-endian bits.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return bits[:, : self.vocab_size].astype(bool)

    def start_mask(self, grammar: GrammarMatcher) -> None:
        """Start computing ``grammar``'s next mask on a worker, unless it already is."""
        if grammar.next_mask is None:
            grammar.mask_started = time.perf_counter()
            grammar.mask_running_since = None
            grammar.next_mask = self._workers.submit(self._compute, grammar)

    def _compute(self, grammar: GrammarMatcher) -> np.ndarray:
        started = time.perf_counter()
        grammar.mask_running_since = started
        try:
            return self.masks([grammar])[0]
        finally:
            seconds = time.perf_counter() - started
            grammar.last_mask_seconds = seconds
            grammar.mask_seconds += seconds
            grammar.mask_running_since = None
            if self.on_mask is not None:
                self.on_mask(seconds)

    def collect(self, grammars: Sequence[GrammarMatcher]) -> list[np.ndarray | Exception | None]:
        """Each grammar's next mask (started by ``start_mask``), waited for up to the step budget
        from when it started: the mask; None when it is not ready (the row is deferred); or
        GrammarBudgetExceeded when the request's budget is spent or llguidance refused it."""
        results: list[np.ndarray | Exception | None] = []
        for grammar in grammars:
            future = grammar.next_mask
            assert future is not None, "start_mask comes first"
            now = time.perf_counter()
            if not future.done():
                deadline = grammar.mask_started + self.budget.step_seconds
                wait([future], timeout=max(0.0, deadline - now))
                now = time.perf_counter()
            results.append(self._outcome(grammar, future, now))
        return results

    def _outcome(
        self, grammar: GrammarMatcher, future: Future[np.ndarray], now: float
    ) -> np.ndarray | Exception | None:
        if not future.done():
            if grammar.spent(now) > self.budget.request_seconds:
                return self._over_budget(grammar)
            return None
        if future.exception() is not None or grammar.llguidance_matcher.is_error():
            # llguidance's step fuel or item limit: the grammar cannot go on.
            return GrammarBudgetExceeded(
                "the output grammar was refused mid-generation: it needs more than one step's"
                " parser budget (make it less ambiguous)"
            )
        if grammar.mask_seconds > self.budget.request_seconds:
            return self._over_budget(grammar)
        return future.result()

    def _over_budget(self, grammar: GrammarMatcher) -> GrammarBudgetExceeded:
        return GrammarBudgetExceeded(
            f"the output grammar spent its mask budget of {self.budget.request_seconds:g} s"
            " (make it less ambiguous)"
        )


def _yield_to_the_engine() -> None:
    """Run this mask worker below the engine thread's CPU priority (Linux: per thread), so that a
    hostile grammar's masks take the CPU the forward passes leave, not the forwards' own."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MASK_WORKER_NICENESS)
