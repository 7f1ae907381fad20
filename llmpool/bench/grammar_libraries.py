"""llguidance against xgrammar on the built-in model's tokenizer: compile time and mask time.

How llmpool chose its grammar library (engine/structured_outputs.py). For each schema: the time
to compile it (no cache) and to fill one token mask from the start state, and for a typical
record the mask-and-advance time per token over its JSON text. xgrammar is not a dependency of
llmpool; install it into the environment to run this:

    pip install xgrammar==0.2.8 && python benchmarks/grammar_libraries.py
"""

from __future__ import annotations

import json
import time
from importlib.metadata import version
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import xgrammar
from transformers import AutoTokenizer

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.engine import model_source

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
PERSON_TEXT = json.dumps(
    {"name": "Bob", "age": 31, "tags": ["a", "c"], "address": {"city": "Paris", "zip": "75001"}}
)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"k": schema}, "required": ["k"]}
    return schema


SCHEMAS = {
    "person": PERSON,
    "enum of 5,000": {"enum": [f"value-{i}-x" for i in range(5000)]},
    "40 levels deep": nested(40),
    "300 required fields": {
        "type": "object",
        "properties": {f"f{i}": {"type": "string"} for i in range(300)},
        "required": [f"f{i}" for i in range(300)],
    },
    "recursive tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["v", "children"],
            }
        },
        "$ref": "#/$defs/node",
    },
}


def timed(action: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = action()
    return result, (time.perf_counter() - started) * 1000


def main() -> int:
    tokenizer = AutoTokenizer.from_pretrained(model_source.resolve(None).folder)
    vocab = len(tokenizer)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    xg_compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), cache_enabled=False
    )
    ll_mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    xg_mask = xgrammar.allocate_token_bitmask(1, vocab)
    results: dict[str, dict[str, float]] = {}
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        ll_matcher, ll_compile = timed(lambda g=grammar: llguidance.LLMatcher(ll_tokenizer, g))
        _, ll_first = timed(
            lambda m=ll_matcher: m.unsafe_compute_mask_ptr(ll_mask.ctypes.data, ll_mask.nbytes)
        )
        compiled, xg_compile = timed(
            lambda s=schema: xg_compiler.compile_json_schema(json.dumps(s))
        )
        xg_matcher = xgrammar.GrammarMatcher(compiled)
        _, xg_first = timed(lambda m=xg_matcher: m.fill_next_token_bitmask(xg_mask))
        results[name] = {
            "llguidance_compile_ms": ll_compile,
            "llguidance_first_mask_ms": ll_first,
            "xgrammar_compile_ms": xg_compile,
            "xgrammar_first_mask_ms": xg_first,
        }
        print(name, json.dumps(results[name]), flush=True)

    tokens = tokenizer.encode(PERSON_TEXT, add_special_tokens=False)
    ll_matcher = llguidance.LLMatcher(
        ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    )
    xg_matcher = xgrammar.GrammarMatcher(xg_compiler.compile_json_schema(json.dumps(PERSON)))

    def walk_llguidance() -> None:
        for token in tokens:
            ll_matcher.unsafe_compute_mask_ptr(ll_mask.ctypes.data, ll_mask.nbytes)
            assert ll_matcher.consume_token(token)

    def walk_xgrammar() -> None:
        for token in tokens:
            xg_matcher.fill_next_token_bitmask(xg_mask)
            assert xg_matcher.accept_token(token)

    per_token = {
        "llguidance_mask_ms_per_token": timed(walk_llguidance)[1] / len(tokens),
        "xgrammar_mask_ms_per_token": timed(walk_xgrammar)[1] / len(tokens),
    }
    print("per token", json.dumps(per_token))
    report = {
        "versions": {name: version(name) for name in ("llguidance", "xgrammar")},
        "schemas": results,
        "person_walk": per_token,
    }
    write_json(RESULTS / "grammar_libraries.json", report, script_command(__file__))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
