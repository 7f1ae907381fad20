"""Structured outputs: tokens per second of json_schema requests against unconstrained ones.

One engine, one process: at each concurrency a closed loop keeps that many requests in flight,
without a grammar (``ignore_eos``, so each runs to ``--max-tokens``) and with a JSON schema of
a list of records (each ends when its JSON is complete or at ``--max-tokens``), alternating,
``--repeats`` times each, the fastest run of each kept. Tokens per second count every
generated token over the loop's wall time. The mask time per token is what llguidance spent
filling the masks, from the engine's counters; the wait is what steps spent waiting for masks
after their forward pass (the rest ran beside it).

    python benchmarks/structured_outputs.py --requests 8 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.structured_outputs import StructuredOutputsParams

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "member": {"type": "boolean"},
        "tier": {"enum": ["bronze", "silver", "gold"]},
    },
    "required": ["name", "age", "city", "member", "tier"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 6, "maxItems": 6}
TOPICS = ["a chess club", "a hospital ward", "a football team", "a library", "a startup"]


def build_prompts(engine: EngineCore, count: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    prompts = []
    for index in range(count):
        ask = (
            f"List six members of {TOPICS[index % len(TOPICS)]} as a JSON array of objects with"
            f" name, age, city, member and tier (request {index})."
        )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run(
    engine: EngineCore, prompts: list[list[int]], concurrency: int, params: SamplingParams
) -> dict[str, float]:
    """A closed loop at ``concurrency``; generated tokens, wall time and the mask counters."""
    pending = list(enumerate(prompts))
    in_flight = tokens = 0
    before = engine.stats()
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, params)
            in_flight += 1
        for delta in engine.step():
            tokens += len(delta.new_token_ids)
            if delta.finished:
                in_flight -= 1
    wall = time.perf_counter() - started
    after = engine.stats()
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "mask_s": after.grammar_mask_seconds - before.grammar_mask_seconds,
        "mask_wait_s": after.grammar_wait_seconds - before.grammar_wait_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=32, help="per level; at least the concurrency"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, best kept")
    parser.add_argument("--dtype", default="auto")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    engine = EngineCore(
        EngineConfig(max_model_len=1024, max_num_seqs=max(args.concurrency), dtype=args.dtype)
    )
    prompts = build_prompts(engine, max(args.requests, *args.concurrency))
    grammar = StructuredOutputsParams(json=SCHEMA)
    engine.structured_outputs.compile(grammar)
    modes = {
        "unconstrained": SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
        "json_schema": SamplingParams(
            temperature=0, max_tokens=args.max_tokens, structured_outputs=grammar
        ),
    }
    run(engine, prompts[:2], 2, modes["json_schema"])  # warm-up: first steps of each shape
    results: dict[str, dict[str, dict[str, float]]] = {}
    for concurrency in args.concurrency:
        count = max(args.requests, concurrency)
        best: dict[str, dict[str, float]] = {}
        # Modes alternate, and each keeps its fastest run: load from other work on the machine
        # then weighs on both alike.
        for _ in range(args.repeats):
            for mode, params in modes.items():
                result = run(engine, prompts[:count], concurrency, params)
                result["mask_ms_per_token"] = 1000 * result["mask_s"] / result["tokens"]
                print(concurrency, mode, json.dumps(result), flush=True)
                if mode not in best or result["tok_per_s"] > best[mode]["tok_per_s"]:
                    best[mode] = result
        results[str(concurrency)] = best
    report = {
        "torch_threads": torch.get_num_threads(),
        "dtype": engine.resolved_dtype.name,
        "results": results,
        "json_schema_vs_unconstrained_tok_per_s": {
            c: r["json_schema"]["tok_per_s"] / r["unconstrained"]["tok_per_s"]
            for c, r in results.items()
        },
    }
    report = write_json(RESULTS / "structured_outputs.json", report, script_command(__file__, argv))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
