"""Prefix caching: TTFT of chat requests behind one long shared system prompt, cache on vs off.

A closed loop keeps ``--concurrency`` requests in flight; each is the same ~1,000-token system
prompt plus a short user turn of its own, and a new one arrives whenever one finishes. TTFT is
measured from engine timestamps (first token's step end minus arrival). Both engines run in the
same process one after the other, on the same requests.

    python benchmarks/prefix_cache.py --requests 48 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from llmpool.bench.results import RESULTS, grouped_bars, script_command, write_json
from llmpool.bench.stats import percentile
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.sampling_params import SamplingParams

SYSTEM_PARAGRAPH = (
    "You are the support assistant of a public library network. Members borrow books, films and"
    " music, renew loans online, reserve items held at other branches and pay small fines. Be"
    " polite and brief, give opening hours only from the table you were given, never invent a"
    " policy, and ask a clarifying question when a request is ambiguous. "
)
USER_TURNS = [
    "How do I renew a book?",
    "Is the central branch open on Sunday?",
    "Can I reserve a film from another branch?",
    "What happens if I return a book late?",
    "How many items can I borrow at once?",
    "Do you lend e-books?",
    "I lost my library card. What now?",
    "Can children get their own card?",
]


def build_prompts(engine: EngineCore, system_tokens: int, count: int) -> list[list[int]]:
    """Chat-templated prompts whose system message is exactly ``system_tokens`` tokens."""
    tokenizer = engine.tokenizer
    paragraph = tokenizer.encode(SYSTEM_PARAGRAPH, add_special_tokens=False)
    system_ids = (paragraph * (system_tokens // len(paragraph) + 1))[:system_tokens]
    system = tokenizer.decode(system_ids)
    prompts = []
    for index in range(count):
        turn = f"{USER_TURNS[index % len(USER_TURNS)]} (ticket {index})"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": turn}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run(engine: EngineCore, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """Closed loop at ``concurrency``; returns TTFTs in seconds and the prefix-cache counters."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    arrival: dict[str, float] = {}
    ttft: dict[str, float] = {}
    pending = list(enumerate(prompts))
    in_flight = 0
    queries_before, hits_before = (
        engine.stats().prefix_cache_queries,
        engine.stats().prefix_cache_hits,
    )
    started = time.monotonic()

    def submit() -> None:
        nonlocal in_flight
        index, prompt = pending.pop(0)
        arrival[str(index)] = time.monotonic()
        engine.add_request(str(index), prompt, params, arrival_time=arrival[str(index)])
        in_flight += 1

    while pending and in_flight < concurrency:
        submit()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.monotonic()
        for delta in deltas:
            ttft.setdefault(delta.request_id, now - arrival[delta.request_id])
            if delta.finished:
                in_flight -= 1
                if pending:
                    submit()
    return {
        "ttft_s": [ttft[str(i)] for i in range(len(prompts))],
        "wall_s": time.monotonic() - started,
        "prefix_cache_queries": engine.stats().prefix_cache_queries - queries_before,
        "prefix_cache_hits": engine.stats().prefix_cache_hits - hits_before,
    }


def summarize(result: dict) -> dict:
    ttft = result["ttft_s"]
    queries = result["prefix_cache_queries"]
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": percentile(ttft, 95),
        "wall_s": result["wall_s"],
        "hit_rate": result["prefix_cache_hits"] / queries if queries else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="run one request with the system prompt first, untimed, as steady traffic would have",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    summaries = {}
    for caching in (False, True):
        engine = EngineCore(
            EngineConfig(
                device=args.device,
                max_model_len=2048,
                max_num_seqs=args.concurrency,
                enable_prefix_caching=caching,
            )
        )
        prompts = build_prompts(engine, args.system_tokens, args.requests + args.warm_up)
        if args.warm_up:
            run(engine, prompts[-1:], 1, 1)
            prompts = prompts[:-1]
        name = "cache on" if caching else "cache off"
        summaries[name] = summarize(run(engine, prompts, args.concurrency, args.max_tokens))
        print(name, json.dumps(summaries[name]), flush=True)
        del engine

    off, on = summaries["cache off"], summaries["cache on"]
    report = {
        "settings": vars(args) | {"prompt_tokens": len(prompts[0])},
        "results": summaries,
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p95_speedup": off["ttft_p95_s"] / on["ttft_p95_s"],
    }
    name = "prefix_cache_warm" if args.warm_up else "prefix_cache"
    report = write_json(RESULTS / f"{name}.json", report, script_command(__file__, argv))
    write_table_and_plot(report, name)
    print(json.dumps(report, indent=2))
    return 0


def write_table_and_plot(report: dict, name: str) -> None:
    results = report["results"]
    lines = [
        "| prefix cache | TTFT p50 (s) | TTFT p95 (s) | wall (s) | hit rate |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {setting} | {r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | {r['wall_s']:.1f}"
        f" | {100 * r['hit_rate']:.1f}% |"
        for setting, r in results.items()
    ]
    lines += [
        "",
        f"TTFT p50 {report['ttft_p50_speedup']:.1f}x lower, p95"
        f" {report['ttft_p95_speedup']:.1f}x lower with the cache on.",
        f"Command: `{report['command']}` on {report['cpu']}",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    settings = report["settings"]
    grouped_bars(
        results,
        {"ttft_p50_s": "p50", "ttft_p95_s": "p95"},
        list(results),
        "TTFT (s)",
        f"Shared {settings['system_tokens']:,}-token system prompt, concurrency"
        f" {settings['concurrency']}" + (", warm cache" if settings["warm_up"] else ""),
        RESULTS / f"{name}.png",
    )


if __name__ == "__main__":
    raise SystemExit(main())
