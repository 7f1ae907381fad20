"""The gateway's routing against a Service's round robin and client-side least-loaded, in one run.

Three `llmpool serve` replicas of the built-in model, each with a KV pool that holds the system
prompts of only some tenants. A closed loop keeps ``--concurrency`` chat requests in flight; each
is one tenant's long system prompt plus a short question. The same requests go, in turn,

* through the gateway (prefix affinity with bounded loads),
* round robin straight to the replicas (what a Service's kube-proxy does),
* to the replica with the fewest requests in flight from this client (least-loaded),

each policy with its own system prompts (a tag in front), so no policy profits from another's
cache. Reported per policy: TTFT p50/p95 (first streamed token, client side), output tokens per
second, the replicas' prefix-cache hit rate. Then a burst (``--burst`` requests in one second,
distinct prompts) through the gateway, reported as the largest replica share over the mean, and
the gateway's added latency (tiny requests, one at a time, gateway vs direct, interleaved).

    python benchmarks/gateway_routing.py --tenants 12 --system-tokens 1000 --requests 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from llmpool.bench.launch import free_port, start_server
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.stats import percentile
from llmpool.gateway.app import GatewaySettings, build_app
from llmpool.gateway.pools import Pool, PoolTable

MODEL = "smollm2-135m-instruct"
WORDS = ("library", "branch", "loan", "renewal", "reservation", "fine", "opening", "hours",
         "member", "card", "film", "music", "e-book", "children", "policy", "question", "polite",
         "brief", "table", "clarify")  # fmt: skip
QUESTIONS = ["How do I renew a book?", "Is the branch open on Sunday?", "Can I reserve a film?",
             "What if I return a book late?", "How many items can I borrow?"]  # fmt: skip


def start_gateway(urls: list[str]) -> tuple[uvicorn.Server, str]:
    table = PoolTable()
    table.set_pool(Pool("bench", "pool", MODEL, "interactive", True, None, frozenset()))
    for index, url in enumerate(urls):
        port = int(url.rsplit(":", 1)[1])
        endpoint = {"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                    "targetRef": {"name": f"replica-{index}"}}  # fmt: skip
        table.set_slice(
            {
                "metadata": {
                    "name": f"r{index}",
                    "namespace": "bench",
                    "labels": {"kubernetes.io/service-name": "pool"},
                },
                "ports": [{"name": "http", "port": port}],
                "endpoints": [endpoint],
            }  # fmt: skip
        )
    table.synced = True
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(table, GatewaySettings()), port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def system_prompt(tag: str, tenant: int, tokens: int) -> str:
    """About ``tokens`` tokens of tenant-specific text (one word is about one token)."""
    rng = random.Random(f"{tag}/{tenant}")
    words = tokens * 9 // 10  # the tokenizer makes about 1.1 tokens of each word
    return f"[{tag}] Tenant {tenant}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def replica_counters(urls: list[str]) -> dict[str, float]:
    totals: Counter[str] = Counter()
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            for sample in family.samples:
                if sample.name in ("llmpool:prefix_cache_hits_total",
                                   "llmpool:prefix_cache_queries_total"):  # fmt: skip
                    totals[sample.name] += sample.value
    return dict(totals)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, int]:
    """(TTFT, completion tokens) of one streamed chat request."""
    started = time.monotonic()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.monotonic() - started
    return (ttft if ttft is not None else time.monotonic() - started), tokens


async def closed_loop(
    pick: Callable[[], str],
    done: Callable[[str], None],
    bodies: list[dict],
    concurrency: int,
) -> tuple[list[float], int, float]:
    queue = list(bodies)
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=None) as client:

        async def worker() -> None:
            nonlocal tokens
            while queue:
                body = queue.pop(0)
                url = pick()
                try:
                    ttft, count = await stream_one(client, url, body)
                finally:
                    done(url)
                ttfts.append(ttft)
                tokens += count

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, tokens, time.monotonic() - started


def policies(gateway: str, urls: list[str]) -> dict[str, tuple[Callable[[], str], Callable]]:
    turn = iter(range(10**9))
    in_flight = dict.fromkeys(urls, 0)

    def least_loaded() -> str:
        low = min(in_flight.values())
        url = random.choice([u for u, n in in_flight.items() if n == low])
        in_flight[url] += 1
        return url

    def release(url: str) -> None:
        if url in in_flight:
            in_flight[url] -= 1

    return {
        "gateway (prefix affinity)": (lambda: gateway, lambda url: None),
        "round robin (Service)": (lambda: urls[next(turn) % len(urls)], lambda url: None),
        "least loaded": (least_loaded, release),
    }


async def burst(gateway_url: str, gateway_metrics: Callable[[], dict], count: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:

        async def one(index: int) -> None:
            await asyncio.sleep(index / count)  # spread over one second
            body = {"model": MODEL, "prompt": f"Request {index}: the weather is", "max_tokens": 1}
            (await client.post(f"{gateway_url}/v1/completions", json=body)).raise_for_status()

        await asyncio.gather(*(one(i) for i in range(count)))
    shares = gateway_metrics()
    mean = count / len(shares)
    return {"per_replica": shares, "max_over_mean": max(shares.values()) / mean}


def gateway_requests(gateway_url: str) -> dict[str, float]:
    per_replica: Counter[str] = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{gateway_url}/metrics").text):
        for sample in family.samples:
            if sample.name == "llmpool_gateway:requests_total":
                per_replica[sample.labels["replica"]] += sample.value
    return dict(per_replica)


def overhead(gateway_url: str, direct_url: str, count: int) -> dict:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    timings: dict[str, list[float]] = {"gateway": [], "direct": []}
    with httpx.Client(timeout=60) as client:
        for _ in range(count):
            for name, url in (("gateway", gateway_url), ("direct", direct_url)):
                started = time.perf_counter()
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
                timings[name].append(time.perf_counter() - started)
    added = [g - d for g, d in zip(timings["gateway"], timings["direct"], strict=True)]
    return {
        "direct_p50_ms": 1000 * statistics.median(timings["direct"]),
        "gateway_p50_ms": 1000 * statistics.median(timings["gateway"]),
        "added_p50_ms": 1000 * statistics.median(added),
        "added_p99_ms": 1000 * percentile(added, 99),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=96, help="per policy")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    # Room for about 6 prefixes of 1,000 tokens in bfloat16 (23 KiB a token; 3 in float32): a
    # replica holds its own tenants but not all twelve. 320MiB held all twelve in bfloat16, and
    # round robin then hit the cache as often as prefix routing (TTFT p50 1.16x, no signal).
    parser.add_argument("--kv-cache-memory", default="160MiB", help="per replica")
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--overhead-requests", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS / "gateway_routing.json")
    return parser.parse_args()


def chat_bodies(policy: str, args: argparse.Namespace) -> list[dict]:
    """The policy's ``--requests`` streamed chats, tenants drawn alike for every policy."""
    rng = random.Random(0)
    bodies = []
    for index in range(args.requests):
        tenant = rng.randrange(args.tenants)
        messages = [
            {"role": "system", "content": system_prompt(policy, tenant, args.system_tokens)},
            {"role": "user", "content": f"{QUESTIONS[index % len(QUESTIONS)]} #{index}"},
        ]
        bodies.append({
            "model": MODEL, "messages": messages, "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        })  # fmt: skip
    return bodies


def run_policy(
    policy: str, pick: Callable[[], str], done: Callable, urls: list[str], args: argparse.Namespace
) -> dict[str, float]:
    before = replica_counters(urls)
    bodies = chat_bodies(policy, args)
    ttfts, tokens, wall = asyncio.run(closed_loop(pick, done, bodies, args.concurrency))
    after = replica_counters(urls)
    hits, queries = (
        after[f"llmpool:prefix_cache_{kind}_total"] - before[f"llmpool:prefix_cache_{kind}_total"]
        for kind in ("hits", "queries")
    )
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": percentile(ttfts, 95),
        "output_tokens_per_s": tokens / wall,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "wall_s": wall,
    }


def measure(gateway_url: str, urls: list[str], args: argparse.Namespace) -> dict:
    """Every policy in turn, then the burst and the gateway's added latency."""
    results: dict = {"settings": vars(args) | {"out": str(args.out)}, "policies": {}}
    for name, (pick, done) in policies(gateway_url, urls).items():
        results["policies"][name] = run_policy(name, pick, done, urls, args)
        print(name, json.dumps(results["policies"][name]), flush=True)
    gateway, round_robin = (results["policies"][k] for k in list(results["policies"])[:2])
    results["ttft_p50_round_robin_over_gateway"] = round_robin["ttft_p50_s"] / gateway["ttft_p50_s"]
    results["throughput_gateway_over_round_robin"] = (
        gateway["output_tokens_per_s"] / round_robin["output_tokens_per_s"]
    )
    before_burst = gateway_requests(gateway_url)
    results["burst"] = asyncio.run(
        burst(
            gateway_url,
            lambda: {
                k: v - before_burst.get(k, 0) for k, v in gateway_requests(gateway_url).items()
            },
            args.burst,
        )
    )
    results["overhead"] = overhead(gateway_url, urls[0], args.overhead_requests)
    results["load_average"] = os.getloadavg()
    return results


def main() -> int:
    args = parse_args()
    logs = Path(tempfile.mkdtemp(prefix="gateway_routing_"))  # replica logs, kept for a look
    serve_args = ["--max-model-len", str(args.system_tokens + 512), "--max-num-seqs", "16",
                  "--kv-cache-memory", args.kv_cache_memory, "--no-access-log"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    replicas = [
        start_server(serve_args, logs / f"replica-{i}.log", env=env) for i in range(args.replicas)
    ]
    urls = [url for _, url in replicas]
    server, gateway_url = start_gateway(urls)
    try:
        results = measure(gateway_url, urls, args)
    finally:
        server.should_exit = True
        for process, _ in replicas:
            process.terminate()
            process.wait(60)
    results = write_json(args.out, results, script_command(__file__))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
