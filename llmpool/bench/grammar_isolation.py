"""Inter-token latency of plain requests with and without a pathological grammar beside them.

One ``llmpool serve`` (the built-in model) serves both phases of one run, one after the other:

- alone: ``--requests`` plain streamed completions (a fixed token-id prompt, ``--max-tokens``
  tokens with ``ignore_eos``, greedy), one at a time;
- beside a grammar: the same requests while a hostile client keeps one request with an
  ambiguous Lark grammar streaming (sent again whenever the last one ends, by completing or by
  ``grammar_budget_exceeded``). Its masks grow from milliseconds to tenths of a second a token.

It reports the plain requests' ITL p50/p95 (gaps between SSE chunks as received) per phase,
how the hostile requests ended, and the server's ``grammar_rows_deferred`` and
``grammar_budget_exceeded`` counters, and how many plain texts differ between the phases (a batch
of two rows rounds differently from one in bfloat16; ``--serve-args "--dtype float32"`` to check).
Written to ``benchmarks/results/grammar_isolation.{json,md}`` with the CPU model.

    python benchmarks/grammar_isolation.py --requests 4 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

from llmpool.bench.launch import start_server
from llmpool.bench.results import script_command, write_report
from llmpool.bench.server_overhead import stream_once
from llmpool.bench.stats import percentile

# Ambiguous (``e e`` and ``e e e`` split any run many ways): Earley sets, and masks, grow with
# the output (tests/test_grammar_budget.py uses the same grammar).
HOSTILE_GRAMMAR = 'start: e\ne: e e | e e e | "(" e ")" | e " " e | /[a-z ]/'
PLAIN_PROMPT = list(range(1000, 1032))


def hostile_client(url: str, stop: threading.Event, outcomes: list[str]) -> None:
    """Keep one hostile grammar request streaming until ``stop``; each one's outcome recorded."""
    body = {
        "prompt": "Write letters and brackets:",
        "max_tokens": 256,
        "temperature": 0.0,
        "stream": True,
        "structured_outputs": {"grammar": HOSTILE_GRAMMAR},
    }
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            outcome = "no end"
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        outcome = chunk["error"]["code"]
                    elif chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                        outcome = chunk["choices"][0]["finish_reason"]
            outcomes.append(outcome)


def phase(client: httpx.Client, requests: int, max_tokens: int) -> tuple[list[float], list[str]]:
    gaps: list[float] = []
    texts = []
    for _ in range(requests):
        request_gaps, chunks, text = stream_once(client, PLAIN_PROMPT, max_tokens)
        if chunks != max_tokens:
            raise RuntimeError(f"a plain stream had {chunks} chunks for {max_tokens} tokens")
        gaps += request_gaps
        texts.append(text)
    return gaps, texts


def counters(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").raise_for_status().text
    names = ("grammar_rows_deferred_total", "grammar_budget_exceeded_total")
    found = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(f"llmpool:{name}{{"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found


def summary(gaps: list[float]) -> dict[str, float]:
    return {
        "itl_p50_ms": statistics.median(gaps) * 1000,
        "itl_p95_ms": percentile(gaps, 95) * 1000,
        "itl_max_ms": max(gaps) * 1000,
        "intervals": len(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4, help="plain requests per phase")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the server")
    parser.add_argument("--serve-args", default="", help="more `llmpool serve` flags")
    args = parser.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="grammar-isolation-")) / "serve.log"
    serve = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB", "--no-access-log"]
    env = {**os.environ, "OMP_NUM_THREADS": args.threads}
    process, url = start_server(serve + args.serve_args.split(), log, env)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            phase(client, 1, 4)  # warm
            alone, alone_texts = phase(client, args.requests, args.max_tokens)
            before = counters(client)
            stop, outcomes = threading.Event(), []
            hostile = threading.Thread(target=hostile_client, args=(url, stop, outcomes))
            hostile.start()
            try:
                beside, beside_texts = phase(client, args.requests, args.max_tokens)
            finally:
                stop.set()
                hostile.join()
            after = counters(client)
    finally:
        process.terminate()
        process.wait(60)
    report: dict[str, Any] = {
        "settings": vars(args),
        "alone": summary(alone),
        "beside_hostile_grammar": summary(beside),
        "hostile_outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
        "counters_during": {name: after[name] - before.get(name, 0.0) for name in after},
        # Batches of two rows round differently from one in bfloat16: a near tie may flip.
        "plain_texts_changed": sum(a != b for a, b in zip(alone_texts, beside_texts, strict=True)),
    }
    write_report("grammar_isolation", report, script_command(__file__, argv), markdown)
    return 0


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| plain requests | ITL p50 (ms) | ITL p95 (ms) | ITL max (ms) | intervals |",
        "|---|---|---|---|---|",
    ]
    for name in ("alone", "beside_hostile_grammar"):
        r = report[name]
        lines.append(
            f"| {name.replace('_', ' ')} | {r['itl_p50_ms']:.1f} | {r['itl_p95_ms']:.1f}"
            f" | {r['itl_max_ms']:.1f} | {r['intervals']} |"
        )
    lines += [
        "",
        f"Hostile grammar requests: {report['hostile_outcomes']}; during them:"
        f" {report['counters_during']}; plain texts that differ from alone:"
        f" {report['plain_texts_changed']} of {report['settings']['requests']}.",
        "",
        f"Command: `{report['command']}` on {report['cpu']}",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
