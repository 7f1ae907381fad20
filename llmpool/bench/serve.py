"""`llmpool bench serve`: a streaming load generator for OpenAI-compatible completions endpoints.

One run measures ``--url`` (ours) and every ``--against`` peer on the same workload: for each
concurrency level it sends ``--num-prompts`` streaming requests (one number, or one per level),
or ``--rounds`` times the concurrency so that every level keeps its slots busy for as many rounds, at most ``concurrency``
in flight and, with ``--request-rate``, Poisson arrivals. Prompts are text of ``--input-len``
words (``N`` or ``LOW-HIGH``, the first ``--shared-prefix-len`` words common to all), each with
exactly ``--output-len`` output tokens (``N`` or ``LOW-HIGH``, via ``ignore_eos``); each level's
requests are fresh, and identical for every target. The targets run one after the other within a
level, their order alternating from level to level, each warmed up by one request first.

A token arrives with a stream chunk that carries text: TTFT is the time to the first, ITL the gaps
between them. Output tokens are the server's ``usage.completion_tokens`` (asked for with
``stream_options.include_usage``; llama.cpp's server reports it in the last chunk regardless),
or the number of text chunks where a server reports no usage; the report says which per level.

It reports TTFT, TPOT, ITL and end-to-end latency percentiles and request and output-token
throughput per target, each level's throughput also as a ratio to the lowest level's, and for each
peer the ratios ours / peer of output tok/s, ITL p50 and TTFT p50 at each level; it writes JSON,
a markdown table and a PNG plot.
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
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from llmpool.bench.compare import (
    Target,
    check_unique,
    comparison_table,
    level_ratios,
    parse_target,
)
from llmpool.bench.results import cpu_description
from llmpool.bench.roof import MachineRoof, ModelShape, describe, measure_machine, workload_roof
from llmpool.bench.stats import PERCENTILES, percentiles
from llmpool.bench.workload import WorkItem, make_levels, parse_length_range

OURS = "llmpool"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds from sending to the first text chunk
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None
    counted_by: str = "chunks"  # where output_tokens came from: "usage" or "chunks"
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
    output_throughput_ratio: float  # against the lowest concurrency level of this target
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: dict[str, int]  # failed requests by error message
    prompt_tokens_mean: float = math.nan  # as the server counted them (its tokenizer)
    output_tokens_counted_by: str = "usage"  # "usage", "chunks" or "mixed"
    load_average_1m: float = math.nan  # of the machine, right after the level
    roof_s: float = math.nan  # with --roof: the least time this machine could serve the level in
    fraction_of_roof: float = math.nan  # roof_s over duration_s


def read_chunk(chunk: dict[str, Any], result: RequestResult) -> bool:
    """Fold one stream chunk into ``result``; True if it carried text (a token arrival)."""
    if usage := chunk.get("usage"):
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage.get("prompt_tokens")
        result.counted_by = "usage"
    choices = chunk.get("choices") or [{}]
    if choices[0].get("text"):
        if result.counted_by == "chunks":
            result.output_tokens += 1
        return True
    return False


async def send_request(
    client: httpx.AsyncClient, model: str, item: WorkItem, temperature: float
) -> RequestResult:
    body = {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.output_len,
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
                if read_chunk(chunk, result):
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
    send: Callable[[WorkItem], Awaitable[RequestResult]],
    items: list[WorkItem],
    concurrency: int,
    request_rate: float,
    seed: int,
    progress: tqdm,
) -> tuple[list[RequestResult], float]:
    """All items at most ``concurrency`` at a time; returns the results and the wall time."""
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def one(item: WorkItem) -> RequestResult:
        async with limit:
            result = await send(item)
        progress.update()
        return result

    started = time.perf_counter()
    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(one(item)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def summarize(
    concurrency: int,
    results: list[RequestResult],
    duration: float,
    roof: tuple[ModelShape, MachineRoof] | None = None,
) -> LevelSummary:
    """One level's numbers; with ``roof``, also its roof (when the server counted every prompt)."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    counted_by = {r.counted_by for r in done}
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    roof_s = math.nan
    if roof is not None and done and len(prompt_tokens) == len(done):
        sizes = [(p, r.output_tokens) for p, r in zip(prompt_tokens, done, strict=True)]
        roof_s = workload_roof(*roof, sizes, concurrency).seconds
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
        prompt_tokens_mean=float(np.mean(prompt_tokens)) if prompt_tokens else math.nan,
        output_tokens_counted_by=counted_by.pop() if len(counted_by) == 1 else "mixed",
        roof_s=roof_s,
        fraction_of_roof=roof_s / duration,
    )


def set_throughput_ratios(levels: list[LevelSummary]) -> None:
    """Each level's output throughput against the lowest concurrency level's."""
    baseline = levels[0].output_throughput
    for level in levels:
        level.output_throughput_ratio = level.output_throughput / baseline if baseline else math.nan


def markdown_table(levels: list[LevelSummary]) -> str:
    def triple(stats: dict[str, float]) -> str:
        return " / ".join(f"{stats[f'p{p}']:,.0f}" for p in PERCENTILES)

    lines = [
        "| concurrency | ok / failed | req/s | output tok/s | vs lowest | TTFT p50/p95/p99 (ms)"
        " | TPOT p50/p95/p99 (ms) | ITL p50/p95/p99 (ms) | E2E p50/p95/p99 (ms) |"
        " prompt tokens (mean) | load (1m) | of roof |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in levels:
        lines.append(
            f"| {level.concurrency} | {level.completed} / {level.failed} | {level.request_throughput:.2f}"
            f" | {level.output_throughput:.1f} | {level.output_throughput_ratio:.2f}x"
            f" | {triple(level.ttft_ms)} | {triple(level.tpot_ms)} | {triple(level.itl_ms)}"
            f" | {triple(level.e2e_ms)} | {level.prompt_tokens_mean:.0f}"
            f" | {level.load_average_1m:.1f} | {100 * level.fraction_of_roof:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def report_markdown(report: dict[str, Any]) -> str:
    """Each target's table and, per peer, the side-by-side table with ratios ours / peer."""
    targets = [report, *report["against"]]
    sections = [f"`{report['command']}`\n"]
    if report["note"]:
        sections.append(report["note"] + "\n")
    for target in targets:
        levels = [LevelSummary(**level) for level in target["levels"]]
        heading = (
            f"### {target['name']}: {target['model']} at {target['url']}\n\n"
            if len(targets) > 1
            else ""
        )
        sections.append(heading + markdown_table(levels))
    for peer in report["against"]:
        sections.append(
            f"### {report['name']} vs {peer['name']} (ratio: {report['name']} / {peer['name']})\n\n"
            + comparison_table(report["name"], report["levels"], peer["name"], peer["levels"])
        )
    return "\n".join(sections)


RATIO_LINES = (
    ("output_throughput_ratio", "tok/s", "o"),
    ("itl_p50_ratio", "ITL p50", "s"),
    ("ttft_p50_ratio", "TTFT p50", "^"),
)


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput and p95 TTFT against concurrency per target (where a curve bends is the cliff);
    with peers, also ITL p50 per target and the ratios ours / each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [report, *report["against"]]
    panels: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
        ("output tokens / s", lambda level: level["output_throughput"]),
        ("p95 time to first token (ms)", lambda level: level["ttft_ms"]["p95"]),
    ]
    if report["against"]:
        panels.append(("p50 inter-token latency (ms)", lambda level: level["itl_ms"]["p50"]))
        figure, grid = plt.subplots(2, 2, figsize=(11, 8))
        axes = list(grid.flat)
    else:
        figure, pair = plt.subplots(1, 2, figsize=(11, 4))
        axes = list(pair)
    concurrency = [level["concurrency"] for level in report["levels"]]
    for axis, (label, value) in zip(axes, panels, strict=False):
        for target in targets:
            values = [value(level) for level in target["levels"]]
            axis.plot(concurrency, values, marker="o", label=target["name"])
        axis.set_ylabel(label)
    for peer_name, ratios in report["ratios"].items():
        for key, label, marker in RATIO_LINES:
            values = [level[key] for level in ratios]
            axes[3].plot(concurrency, values, marker=marker, label=f"{label} vs {peer_name}")
    if report["against"]:
        axes[3].axhline(1.0, color="grey", linewidth=0.8)
        axes[3].set_ylabel(f"{report['name']} / peer")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrency, [str(c) for c in concurrency])
        axis.set_xlabel("concurrency")
        axis.grid(True, alpha=0.3)
        if report["against"]:
            axis.legend(fontsize=8)
    figure.suptitle(", ".join(f"{t['name']}: {t['model']} at {t['url']}" for t in targets))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def host_info() -> dict[str, Any]:
    return {**cpu_description(), "load_average_1_5_15m": os.getloadavg()}


async def first_model(client: httpx.AsyncClient) -> str:
    models = (await client.get("/v1/models")).raise_for_status().json()
    return str(models["data"][0]["id"])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    targets: list[Target] = [args.url, *args.against]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Idle connections expire before the server's keep-alive timeout (uvicorn: 5 s), or a reused
    # one can be closed under a request that was just sent on it.
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, keepalive_expiry=1.0)
    clients = [
        httpx.AsyncClient(base_url=t.url, headers=headers, timeout=None, limits=limits)
        for t in targets
    ]
    sizes = [size for _, size in args.levels]
    warmup, level_items = make_levels(
        sizes, args.input_len, args.output_len, args.shared_prefix_len, args.seed
    )
    try:
        models = [args.model or await first_model(clients[0])]
        models += [await first_model(client) for client in clients[1:]]
        for target, client, model in zip(targets, clients, models, strict=True):
            result = await send_request(client, model, warmup, args.temperature)
            if not result.ok:
                raise RuntimeError(f"{target.name}: warm-up request failed: {result.error}")
        # Measured while every server is idle, before the load: the run's own roof.
        roof = (
            None if args.roof is None else (args.roof, measure_machine(args.roof, args.roof_dtype))
        )
        levels: list[list[LevelSummary]] = [[] for _ in targets]
        with tqdm(total=sum(sizes) * len(targets), desc="bench serve", unit="req") as progress:
            for index, ((concurrency, _), items) in enumerate(
                zip(args.levels, level_items, strict=True)
            ):
                # Alternate which target goes first, so that neither always runs right after
                # the other one's load (or in the same slice of other work on a shared machine).
                order = range(len(targets)) if index % 2 == 0 else reversed(range(len(targets)))
                for t in order:
                    progress.set_postfix_str(f"{targets[t].name} at concurrency {concurrency}")
                    send = partial(
                        send_request, clients[t], models[t], temperature=args.temperature
                    )
                    results, duration = await run_level(
                        send, items, concurrency, args.request_rate, args.seed, progress
                    )
                    summary = summarize(concurrency, results, duration, roof)
                    summary.load_average_1m = os.getloadavg()[0]
                    levels[t].append(summary)
    finally:
        for client in clients:
            await client.aclose()
    return build_report(args, targets, models, levels, host_info(), roof)


def build_report(
    args: argparse.Namespace,
    targets: list[Target],
    models: list[str],
    levels: list[list[LevelSummary]],
    host: dict[str, Any],
    roof: tuple[ModelShape, MachineRoof] | None = None,
) -> dict[str, Any]:
    """The JSON report: ours at the top level (as without peers), peers under ``against``, and
    per peer the ratios ours / peer at each level under ``ratios``."""
    for target_levels in levels:
        set_throughput_ratios(target_levels)
    reports: list[dict[str, Any]] = [
        {"name": t.name, "url": t.url, "model": m, "levels": [asdict(level) for level in lv]}
        for t, m, lv in zip(targets, models, levels, strict=True)
    ]
    return {
        "command": "llmpool bench serve " + shlex.join(args.argv),
        **reports[0],
        "against": reports[1:],
        "ratios": {
            peer["name"]: [
                asdict(level_ratios(mine, theirs))
                for mine, theirs in zip(reports[0]["levels"], peer["levels"], strict=True)
            ]
            for peer in reports[1:]
        },
        "note": args.note,
        "host": host,
        "roof": None if roof is None else describe(*roof),
        "workload": {
            "requests_per_level": [size for _, size in args.levels],
            "input_words": str(args.input_len),
            "output_tokens": str(args.output_len),
            "shared_prefix_words": args.shared_prefix_len,
            "request_rate": args.request_rate,
            "temperature": args.temperature,
            "seed": args.seed,
        },
    }


def plan_levels(
    concurrency: list[int], num_prompts: list[int], rounds: int | None
) -> list[tuple[int, int]]:
    """(concurrency, requests) per level, lowest concurrency first; ``num_prompts`` has one
    number for every level or one per level, and ``rounds`` (rounds x concurrency) overrides it."""
    if len(num_prompts) not in (1, len(concurrency)):
        raise ValueError("--num-prompts needs one number, or one per --concurrency level")
    sizes = num_prompts * len(concurrency) if len(num_prompts) == 1 else num_prompts
    if rounds:
        sizes = [rounds * c for c in concurrency]
    if min(concurrency + sizes) < 1:
        raise ValueError("concurrency, num-prompts and rounds must be positive")
    return sorted(zip(concurrency, sizes, strict=True))


def comma_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="llmpool bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--url",
        type=lambda spec: parse_target(spec, OURS),
        default=parse_target("http://127.0.0.1:8000", OURS),
        help=f"our server: URL or NAME=URL (default name {OURS!r})",
    )
    parser.add_argument(
        "--against",
        type=parse_target,
        action="append",
        default=[],
        help="a peer server measured on the same requests: URL or NAME=URL (repeatable;"
        " default name: its host:port); its model is its /v1/models first",
    )
    parser.add_argument("--model", default=None, help="our model name; default: the server's first")
    parser.add_argument("--api-key", default=None, help="sent to every target")
    parser.add_argument(
        "--concurrency", type=comma_ints, default=[1, 4, 16, 64], help="levels, e.g. 1,16,64"
    )
    parser.add_argument(
        "--num-prompts",
        type=comma_ints,
        default=[64],
        help="requests per concurrency level: one number, or one per level (e.g. 8,64,64)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="instead of --num-prompts: rounds x concurrency requests",
    )
    parser.add_argument(
        "--input-len",
        type=parse_length_range,
        default=parse_length_range("128"),
        help="prompt words: N or LOW-HIGH, drawn per request",
    )
    parser.add_argument(
        "--output-len",
        type=parse_length_range,
        default=parse_length_range("64"),
        help="output tokens: N or LOW-HIGH, drawn per request",
    )
    parser.add_argument(
        "--shared-prefix-len", type=int, default=0, help="prompt words common to all"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (Poisson); inf: all at once",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--roof",
        nargs="?",
        const="builtin",
        default=None,
        metavar="FOLDER",
        help="also report each level's fraction of this machine's roof for the model in FOLDER"
        " (its config.json; default: the built-in model), measured in this run",
    )
    parser.add_argument(
        "--roof-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="the served dtype the roof's GEMM rate and bytes are counted in; auto: what"
        " `llmpool serve` picks on this machine",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results/serve"))
    parser.add_argument(
        "--note", default="", help="recorded in the JSON and markdown (e.g. what else ran)"
    )
    parser.add_argument(
        "--name", default="serve", help="file name stem of the JSON, markdown and PNG"
    )
    args = parser.parse_args(argv)
    try:
        args.levels = plan_levels(args.concurrency, args.num_prompts, args.rounds)
    except ValueError as error:
        parser.error(str(error))
    if args.shared_prefix_len < 0:
        parser.error("shared-prefix-len must not be negative")
    try:
        check_unique([args.url, *args.against])
    except ValueError as error:
        parser.error(str(error))
    if args.roof is not None:
        args.roof, args.roof_dtype = roof_target(args.roof, args.roof_dtype)
    args.argv = argv
    return args


def roof_target(folder: str, dtype: str) -> tuple[ModelShape, str]:
    """The model shape and dtype ``--roof`` and ``--roof-dtype`` name (auto as the server)."""
    import torch

    from llmpool.engine.config import resolve_dtype
    from llmpool.engine.model_source import resolve

    path = resolve(None).folder if folder == "builtin" else Path(folder)
    if dtype == "auto":
        dtype = resolve_dtype("auto", torch.device("cpu")).name
    return ModelShape.from_folder(path), dtype


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except (httpx.HTTPError, RuntimeError) as error:
        print(f"llmpool bench serve: {error}", file=sys.stderr)
        return 1
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / args.name
    markdown = report_markdown(report)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    plot(report, stem.with_suffix(".png"))
    print(markdown, end="")
    print(f"wrote {stem}.json, {stem}.md and {stem}.png", file=sys.stderr)
    return 0
