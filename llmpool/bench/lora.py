"""LoRA throughput: the same batch of requests on the base model alone vs spread over 8 adapters.

One engine (``--max-loras 8``, prefix caching off, so no round reuses another's prompts) with
8 random rank-16 adapters on all 7 projection modules. At each concurrency, rounds alternate
between the base model only and a uniform mix (request ``i`` uses adapter ``i % 8``); every
round is the same ``concurrency`` prompts, all arriving at once, each generating exactly
``--output-len`` tokens. Output tokens/s of each is the median over rounds; the ratio says what
serving adapters costs (1.0: nothing).

    python benchmarks/lora.py --concurrency 16 64 --rounds 3

Writes ``benchmarks/results/lora.json`` and ``lora.md`` with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from llmpool.bench.offline import make_workload, run_llmpool
from llmpool.bench.results import script_command, write_report
from llmpool.engine import LLM, model_source
from llmpool.engine.lora import LORA_TARGETS, LoRARequest
from llmpool.engine.lora.adapter import random_adapter
from llmpool.engine.models.llama import LlamaShape

ADAPTERS = 8
RANK = 16


def make_adapters(folder: Path, shape: LlamaShape) -> list[LoRARequest]:
    """``ADAPTERS`` random rank-16 adapters of every module, each in its own folder."""
    requests = []
    for index in range(ADAPTERS):
        path = folder / f"adapter-{index}"
        random_adapter(path, shape, list(LORA_TARGETS), rank=RANK, alpha=2 * RANK, seed=index)
        requests.append(LoRARequest(f"adapter-{index}", index + 1, str(path)))
    return requests


def measure(
    llm: LLM, adapters: list[LoRARequest], args: argparse.Namespace, vocab_size: int
) -> list[dict[str, Any]]:
    levels = []
    for concurrency in args.concurrency:
        length = (args.prompt_len, args.prompt_len)
        workload = make_workload(
            concurrency, length, (args.output_len, args.output_len), vocab_size, concurrency
        )
        modes: dict[str, list[LoRARequest | None]] = {
            "base": [None] * concurrency,
            "mix": [adapters[i % ADAPTERS] for i in range(concurrency)],
        }
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, lora_request in modes.items():
                rates[mode].append(run_llmpool(llm, workload, lora_request).tokens_per_s)
        base, mix = (statistics.median(rates[mode]) for mode in modes)
        levels.append(
            {
                "concurrency": concurrency,
                "base_tokens_per_s": base,
                "mix_tokens_per_s": mix,
                "mix_over_base": mix / base,
                "rounds_tokens_per_s": rates,
                "load_average": os.getloadavg()[0],
            }
        )
        print(json.dumps(levels[-1]), flush=True)
    return levels


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"{report['cpu']}, {report['cpus']} CPUs, torch threads {report['threads']};"
        f" dtype {report['dtype']}; {ADAPTERS} adapters of rank {RANK} on all 7 modules;"
        f" prompts of {settings['prompt_len']} tokens, {settings['output_len']} output tokens"
        f" each; median of {settings['rounds']} rounds.",
        "",
        "| concurrency | base only tok/s | 8-adapter mix tok/s | mix / base | load average |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {level['concurrency']} | {level['base_tokens_per_s']:.1f}"
        f" | {level['mix_tokens_per_s']:.1f} | {level['mix_over_base']:.2f}x"
        f" | {level['load_average']:.1f} |"
        for level in report["levels"]
    ]
    lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder; default: the built-in model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    config = AutoConfig.from_pretrained(model_source.resolve(args.model).folder)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_lora=True,
        max_loras=ADAPTERS,
        max_lora_rank=RANK,
        enable_prefix_caching=False,
        max_num_seqs=max(args.concurrency),
        max_model_len=args.prompt_len + args.output_len,
    )
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        adapters = make_adapters(Path(folder), LlamaShape.from_hf_config(config))
        # Untimed: loads every adapter and warms both paths up.
        warmup = make_workload(ADAPTERS, (16, 16), (4, 4), config.vocab_size, seed=1)
        run_llmpool(llm, warmup)
        run_llmpool(llm, warmup, adapters)
        levels = measure(llm, adapters, args, config.vocab_size)
    report = {
        "threads": torch.get_num_threads(),
        "dtype": llm.engine.resolved_dtype.name,
        "settings": vars(args),
        "levels": levels,
    }
    write_report("lora", report, script_command(__file__, argv), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
