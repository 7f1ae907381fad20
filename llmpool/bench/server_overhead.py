"""What the HTTP server adds per token over the engine step, at concurrency 1.

One run measures, per dtype, the same request (a fixed token-id prompt, ``--max-tokens`` output
tokens with ``ignore_eos``, greedy) three ways, one request of each in turn so that load from
outside the run falls on all three alike:

- offline: ``EngineCore`` stepped in this process's main thread, as the offline ``LLM`` does;
  the gap between consecutive token-producing steps;
- offline, engine thread: the same engine stepped from a second thread, as the server's engine
  thread does (the main thread waits); this separates what the thread placement costs from
  what HTTP and the event loop cost;
- served: a real ``llmpool serve`` subprocess with the same dtype and thread settings, streamed
  over HTTP with httpx, the gap between consecutive SSE chunks as the client receives them (ITL).
  Every stream must have one chunk per token and the offline engine's text.

It reports ITL p50/p95 of each, the served minus offline per-token difference in ms and the
ratio served/offline against both baselines, and writes
``benchmarks/results/server_overhead.json`` with the CPU model. The idle server only waits on
its queue while the offline engine runs, and the offline engine does nothing while the server
streams.

    OMP_NUM_THREADS=1 python benchmarks/server_overhead.py --dtypes bfloat16 float32 \
        --max-tokens 96 --requests 3

The engine-thread baseline runs in a process whose main thread already ran the engine, so it
holds two OpenMP teams; with two intra-op threads on 2 cores that costs about 2x per token (GNU
OpenMP's workers stop spinning once the process has more OpenMP threads than CPUs). The server
avoids it: it loads the model in a thread that has ended and warms up in the engine thread, so
the engine thread's team is its only one, and served ITL is compared with the offline one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from llmpool.bench.launch import start_server
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.stats import percentile
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.sampling_params import SamplingParams

PROMPT_TOKEN_RANGE = (1000, 20000)  # clear of special tokens, as `llmpool bench serve` draws
START_TIMEOUT_S = 300


def summary(gaps_s: list[float]) -> dict[str, float]:
    return {
        "p50": 1000 * statistics.median(gaps_s),
        "p95": 1000 * percentile(gaps_s, 95),
        "mean": 1000 * statistics.fmean(gaps_s),
        "count": len(gaps_s),
    }


class Offline:
    """The engine stepped alone in this process, as the offline ``LLM`` drives it."""

    def __init__(self, dtype: str, quantization: str, compile_decoder: bool) -> None:
        config = EngineConfig(dtype=dtype, quantization=quantization, compile=compile_decoder)
        self.core = EngineCore(config)
        self.core.wait_for_compile()
        self.count = 0

    def run(self, prompt: list[int], max_tokens: int) -> tuple[list[float], str]:
        """Gaps between consecutive token-producing steps, and the text."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(f"r{self.count}", prompt, params)
        self.count += 1
        gaps: list[float] = []
        text, last = "", None
        while self.core.has_unfinished_requests():
            deltas = self.core.step()
            now = time.perf_counter()
            for delta in deltas:
                text += delta.new_text
                if last is not None:
                    gaps.append(now - last)
                last = now
        return gaps, text

    def run_in_thread(self, prompt: list[int], max_tokens: int) -> tuple[list[float], str]:
        result: list[tuple[list[float], str]] = []
        thread = threading.Thread(target=lambda: result.append(self.run(prompt, max_tokens)))
        thread.start()
        thread.join()
        return result[0]


def stream_once(
    client: httpx.Client, prompt: list[int], max_tokens: int
) -> tuple[list[float], int, str]:
    """Gaps between consecutive token chunks as received, the number of chunks, and the text."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    gaps: list[float] = []
    chunks, text = 0, ""
    last = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            chunks += 1
            text += chunk["choices"][0]["text"]
    return gaps, chunks, text


def measure(
    dtype: str, args: argparse.Namespace, prompt: list[int], log_dir: Path
) -> dict[str, Any]:
    """One offline, one engine-thread and one served request per round, ``requests`` rounds."""
    max_tokens, requests = args.max_tokens, args.requests
    server_args = ["--dtype", dtype, "--quantization", args.quantization]
    if args.compile:
        server_args.append("--compile")
    process, url = start_server(
        server_args, log_dir / f"server-{dtype}.log", timeout=START_TIMEOUT_S
    )
    try:
        offline = Offline(dtype, args.quantization, args.compile)
        gaps: dict[str, list[float]] = {"offline": [], "engine_thread": [], "served": []}
        with httpx.Client(base_url=url, timeout=600) as client:
            for index in range(requests + 1):  # the first round warms up and is not counted
                offline_gaps, expected = offline.run(prompt, max_tokens)
                thread_gaps, thread_text = offline.run_in_thread(prompt, max_tokens)
                served_gaps, chunks, text = stream_once(client, prompt, max_tokens)
                if chunks != max_tokens:
                    raise RuntimeError(f"{chunks} token chunks streamed, expected {max_tokens}")
                if not text == thread_text == expected:
                    raise RuntimeError("the served text differs from the offline engine's")
                if index > 0:
                    gaps["offline"] += offline_gaps
                    gaps["engine_thread"] += thread_gaps
                    gaps["served"] += served_gaps
        del offline
        gc.collect()
    finally:
        process.terminate()
        process.wait(120)
    itl = {name: summary(values) for name, values in gaps.items()}
    served = itl["served"]["p50"]
    row: dict[str, Any] = {
        "dtype": dtype,
        "quantization": args.quantization,
        "compile": args.compile,
        "itl_ms": itl,
    }
    for baseline in ("offline", "engine_thread"):
        row[f"overhead_p50_ms_vs_{baseline}"] = served - itl[baseline]["p50"]
        row[f"ratio_p50_vs_{baseline}"] = served / itl[baseline]["p50"]
    print(
        f"{dtype} {args.quantization}{' compiled' if args.compile else ''}: ITL p50 (p95) offline {itl['offline']['p50']:.2f} ({itl['offline']['p95']:.2f}),"
        f" engine thread {itl['engine_thread']['p50']:.2f} ({itl['engine_thread']['p95']:.2f}),"
        f" served {served:.2f} ({itl['served']['p95']:.2f}) ms;"
        f" served - offline {row['overhead_p50_ms_vs_offline']:+.2f} ms/token"
        f" ({row['ratio_p50_vs_offline']:.3f}x),"
        f" served - engine thread {row['overhead_p50_ms_vs_engine_thread']:+.2f} ms/token"
        f" ({row['ratio_p50_vs_engine_thread']:.3f}x)",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4, help="measured requests per side")
    parser.add_argument("--quantization", default="none", help="as `llmpool serve --quantization`")
    parser.add_argument("--compile", action="store_true", help="as `llmpool serve --compile`")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS / "server_overhead.json")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    prompt = [rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(args.prompt_len)]
    with tempfile.TemporaryDirectory() as log_dir:
        rows = [measure(dtype, args, prompt, Path(log_dir)) for dtype in args.dtypes]
    result = {
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "rows": rows,
    }
    write_json(args.output, result, script_command(__file__, argv))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
