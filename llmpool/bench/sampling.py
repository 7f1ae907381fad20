"""Sampling on CPU: the sampler with ``sampling.c`` against the sampler of another revision
(``--against REV``: its source loaded beside today's), on one step's logits.

For each of greedy, temperature alone, top-p, top-k, and top-k with top-p and a seed, at 1-64
rows (``--rows``) of bfloat16 logits as wide as the built-in model's vocabulary: the two
samplers called on the same rows, alternating. Greedy steps now take ``argmax_bf16`` over the
logits as they come; the others ``keep_thresholds`` (no sort) and one uniform a row (no
exponential noise over the vocabulary).

    python benchmarks/sampling.py --against 01e253a

Writes ``benchmarks/results/sampling.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.revision import module_at_revision
from llmpool.bench.steps import alternating_step_ms
from llmpool.engine import SamplingParams
from llmpool.engine import sampler as current
from llmpool.engine.request import Request

VOCAB = 49152  # SmolLM2's
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},
    "top_p": {"temperature": 0.7, "top_p": 0.9},
    "top_k": {"temperature": 0.7, "top_k": 50},
    "top_k_top_p_seed": {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "seed": 3},
}


def call_milliseconds(
    rows: int, setting: str, samplers: dict[str, Any], rounds: int
) -> dict[str, Any]:
    params = SamplingParams(**SETTINGS[setting])
    requests = [Request(f"r{i}", [1], params, frozenset()) for i in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)).bfloat16()
    ways = {name: lambda s=sampler: s(logits, requests) for name, sampler in samplers.items()}
    with torch.inference_mode():
        ms = alternating_step_ms(ways, rounds, steps=max(2, 64 // rows))
    first, second = samplers
    row = {
        "setting": setting,
        "rows": rows,
        "ms": ms,
        f"{second}_over_{first}": ms[second] / ms[first],
    }
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--against", required=True, help="the git revision to time beside")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="sampling")
    args = parser.parse_args()
    before = module_at_revision(Path(current.__file__), args.against)
    samplers = {"current": current.Sampler(), args.against: before.Sampler()}
    report = {
        "threads": torch.get_num_threads(),
        "against": args.against,
        "calls": [
            call_milliseconds(rows, setting, samplers, args.rounds)
            for setting in SETTINGS
            for rows in args.rows
        ],
    }
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
