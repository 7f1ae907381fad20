"""Structured outputs: grammars compiled from a JSON schema, regex, choices or Lark text, and the
per-request matchers that turn them into token masks at sampling (llguidance).

llguidance was chosen over xgrammar, measured on SmolLM2's tokenizer (``benchmarks/grammar_libraries.py``):
it compiles a schema 3-20x faster (a request's tools are a new grammar per request, so compile
time is per request, not amortized), it has no up-front automaton whose size a schema can blow
up (its Earley parser and lexer run on fuel budgets, ``LIMITS``, so a compile and each mask step
are bounded), and it depends on nothing (xgrammar requires torch, transformers and triton). Its mask
step is slower (0.05 ms against 0.01 ms a token), which is small beside a decode step and
overlapped with the forward pass (``ModelRunner``).

A compiled grammar is cached per spec as a pristine matcher; each request (each of ``n``
choices) starts from a deep copy of it (microseconds), so the engine thread never compiles
what the server compiled beforehand. A matcher lives on its ``Request``: it has consumed exactly
the request's output tokens, so preemption by recompute, prefix caching and streaming leave it
as it is.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
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
# llguidance's fuel budgets bound a compile (lexer fuel, grammar size) and each mask step
# (lexer fuel, Earley items); verbose errors would echo the schema into logs and responses.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis per compile
    step_lexer_fuel=200_000,  # ~15 ms per mask step, at most
    step_max_items=50_000,
    max_grammar_size=200_000,
    verbose_errors=False,
)
# vLLM's JSON defaults: whitespace between tokens is allowed, as models write it.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True}


class GrammarError(ValueError):
    """A spec that cannot become a grammar: too large, invalid, or over the compile budget."""


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

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; raises if the grammar did not allow it (a masking bug)."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        """Nothing more can follow: the request ends here."""
        return self._matcher.is_stopped()


class StructuredOutputManager:
    """One per engine: the tokenizer as llguidance sees it, the grammar cache, and batch masks.

    ``compile`` may run on any thread (the server calls it off the event loop); ``matcher`` and
    ``masks`` run on the engine thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        # The mask covers the model's logits (its vocabulary may be padded past the tokenizer's).
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=sorted(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()
        # Called as (kind, seconds, cache_hit) after each compile; the server's metrics set it.
        self.on_compile: Callable[[str, float, bool], None] | None = None

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
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
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
