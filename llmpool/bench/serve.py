"""`llmpool bench serve`: a streaming load generator for an OpenAI-compatible completions endpoint.

For each concurrency level it sends ``--num-prompts`` streaming requests, or ``--rounds`` times
the concurrency so that every level keeps its slots busy for as many rounds (token-id prompts of
``--input-len`` tokens, the first ``--shared-prefix-len`` of them common to all, and exactly
``--output-len`` output tokens via ``ignore_eos``), at most ``concurrency`` in flight and, with
``--request-rate``, Poisson arrivals. It reports TTFT, TPOT, ITL and end-to-end latency
percentiles and request and output-token throughput, each level's throughput also as a ratio
to the lowest level's (the baseline measured in the same run), and writes JSON, a markdown
table and a PNG plot of throughput and p95 TTFT against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

# Token ids drawn for prompts: inside any Llama-family vocabulary, clear of special tokens.
PROMPT_TOKEN_RANGE = (1000, 20000)
PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds from sending to the first token
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class LevelSummary:
    concurrency: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    output_throughput_ratio: float  # against the lowest concurrency level of this run
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: dict[str, int]  # failed requests by error message


def make_prompts(num: int, input_len: int, shared_prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = PROMPT_TOKEN_RANGE
    prefix = [rng.randrange(low, high) for _ in range(min(shared_prefix_len, input_len))]
    return [
        prefix + [rng.randrange(low, high) for _ in range(input_len - len(prefix))]
        for _ in range(num)
    ]


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean and p50/p95/p99, scaled (seconds to milliseconds by default); NaN when empty."""
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    array = np.asarray(values) * scale
    return {
        "mean": float(array.mean()),
        **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES},
    }


async def send_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, temperature: float
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    result.error = chunk["error"].get("message")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - started
    result.ok = last is not None
    return result


async def run_level(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    prompts: list[list[int]],
    concurrency: int,
    progress: tqdm,
) -> tuple[list[RequestResult], float]:
    """All prompts at most ``concurrency`` at a time; returns the results and the wall time."""
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)

    async def one(prompt: list[int]) -> RequestResult:
        async with limit:
            result = await send_request(
                client, args.model, prompt, args.output_len, args.temperature
            )
        progress.update()
        return result

    started = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def summarize(concurrency: int, results: list[RequestResult], duration: float) -> LevelSummary:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return LevelSummary(
        concurrency=concurrency,
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        output_throughput_ratio=math.nan,
        ttft_ms=percentiles([r.ttft for r in done]),
        tpot_ms=percentiles([t for r in done if (t := r.tpot) is not None]),
        itl_ms=percentiles([gap for r in done for gap in r.itls]),
        e2e_ms=percentiles([r.e2e for r in done]),
        errors=dict(Counter(r.error or "no tokens" for r in results if not r.ok)),
    )


def markdown_table(levels: list[LevelSummary]) -> str:
    def triple(stats: dict[str, float], scale: float = 1.0) -> str:
        return " / ".join(f"{stats[f'p{p}'] / scale:,.0f}" for p in PERCENTILES)

    lines = [
        "| concurrency | ok / failed | req/s | output tok/s | vs lowest | TTFT p50/p95/p99 (ms)"
        " | TPOT p50/p95/p99 (ms) | ITL p50/p95/p99 (ms) | E2E p50/p95/p99 (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in levels:
        lines.append(
            f"| {level.concurrency} | {level.completed} / {level.failed} | {level.request_throughput:.2f}"
            f" | {level.output_throughput:.1f} | {level.output_throughput_ratio:.2f}x"
            f" | {triple(level.ttft_ms)} | {triple(level.tpot_ms)} | {triple(level.itl_ms)}"
            f" | {triple(level.e2e_ms)} |"
        )
    return "\n".join(lines) + "\n"


def plot(levels: list[LevelSummary], path: Path, title: str) -> None:
    """Throughput and p95 TTFT against concurrency: where the curve bends is the cliff."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrency = [level.concurrency for level in levels]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(concurrency, [level.output_throughput for level in levels], marker="o")
    left.set_ylabel("output tokens / s")
    right.plot(concurrency, [level.ttft_ms["p95"] for level in levels], marker="o", color="tab:red")
    right.set_ylabel("p95 time to first token (ms)")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrency, [str(c) for c in concurrency])
        axis.set_xlabel("concurrency")
        axis.grid(True, alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Idle connections expire before the server's keep-alive timeout (uvicorn: 5 s), or a reused
    # one can be closed under a request that was just sent on it.
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, keepalive_expiry=1.0)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=None, limits=limits
    ) as client:
        if args.model is None:
            models = (await client.get("/v1/models")).raise_for_status().json()
            args.model = models["data"][0]["id"]
        level_sizes = [
            args.rounds * c if args.rounds else args.num_prompts for c in args.concurrency
        ]
        # Fresh prompts for the warm-up and for every level: a prefix cache must not carry
        # one level's prompts into the next (only --shared-prefix-len is meant to be shared).
        prompts = make_prompts(
            1 + sum(level_sizes), args.input_len, args.shared_prefix_len, args.seed
        )
        warmup = await send_request(client, args.model, prompts.pop(), 2, args.temperature)
        if not warmup.ok:
            raise RuntimeError(f"warm-up request failed: {warmup.error}")
        levels = []
        with tqdm(total=sum(level_sizes), desc="bench serve", unit="req") as progress:
            for concurrency, size in zip(args.concurrency, level_sizes, strict=True):
                progress.set_postfix_str(f"concurrency {concurrency}")
                level_prompts, prompts = prompts[:size], prompts[size:]
                results, duration = await run_level(
                    client, args, level_prompts, concurrency, progress
                )
                levels.append(summarize(concurrency, results, duration))
    baseline = levels[0].output_throughput
    for level in levels:
        level.output_throughput_ratio = level.output_throughput / baseline if baseline else math.nan
    return {
        "command": "llmpool bench serve " + shlex.join(args.argv),
        "url": args.url,
        "model": args.model,
        "host": {"cpus": os.cpu_count(), "load_average_1_5_15m": os.getloadavg()},
        "workload": {
            "num_prompts": args.num_prompts,
            "rounds": args.rounds,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "shared_prefix_len": args.shared_prefix_len,
            "request_rate": args.request_rate,
            "temperature": args.temperature,
            "seed": args.seed,
        },
        "levels": [asdict(level) for level in levels],
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="llmpool bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", default=None, help="model name; default: the server's first")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--concurrency", type=lambda s: sorted(int(x) for x in s.split(",")), default=[1, 4, 16, 64]
    )
    parser.add_argument(
        "--num-prompts", type=int, default=64, help="requests per concurrency level"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="instead of --num-prompts: rounds x concurrency requests",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens")
    parser.add_argument(
        "--shared-prefix-len", type=int, default=0, help="prompt tokens common to all"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (Poisson); inf: all at once",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results/serve"))
    parser.add_argument(
        "--name", default="serve", help="file name stem of the JSON, markdown and PNG"
    )
    args = parser.parse_args(argv)
    sizes = (
        min(args.concurrency),
        args.num_prompts,
        args.rounds or 1,
        args.input_len,
        args.output_len,
    )
    if min(sizes) < 1:
        parser.error("concurrency, num-prompts, rounds, input-len and output-len must be positive")
    args.argv = argv
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except (httpx.HTTPError, RuntimeError) as error:
        print(f"llmpool bench serve: {args.url}: {error}", file=sys.stderr)
        return 1
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / args.name
    levels = [LevelSummary(**level) for level in report["levels"]]
    table = markdown_table(levels)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"`{report['command']}`\n\n{table}")
    plot(levels, stem.with_suffix(".png"), f"{report['model']} at {args.url}")
    print(table, end="")
    print(f"wrote {stem}.json, {stem}.md and {stem}.png", file=sys.stderr)
    return 0
