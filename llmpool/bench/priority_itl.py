"""Interactive latency while a long batch prompt is admitted: chunked prefill and priority classes.

An interactive stream is decoding when a batch request with a ~7,500-token prompt arrives (the
built-in model has 8,192 positions, so an 8k prompt would leave no room), and a second
interactive request arrives one step later. Three engine settings, one after the other:

- no chunking, no priorities: the step budget holds the whole prompt, every request is equal;
- chunked prefill, no priorities: the prompt runs in budget-sized chunks, first come first served;
- chunked prefill and priorities: as above, with the batch request in the batch class.

Reported per setting, from engine timestamps: inter-token latency (ITL) p50/p95/max of the
interactive streams over the intervals that end while the batch prompt is in prefill, the
second stream's TTFT, and how long the batch prefill took. Prefix caching is off so no setting reuses another's KV.

    python benchmarks/priority_itl.py --batch-tokens 7500 --chunk 512
"""

from __future__ import annotations

import argparse
import itertools
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
from llmpool.protocol.priority import PRIORITY_CLASSES

CHAT_PROMPT = "Write a short story about a lighthouse keeper who befriends a seagull."
BATCH_TEXT = (
    "Quarterly report, section {index}: revenue grew in every region, costs of shipping fell,"
    " and the new warehouse opened on schedule. "
)


def batch_prompt(engine: EngineCore, num_tokens: int) -> list[int]:
    tokens: list[int] = []
    index = 0
    while len(tokens) < num_tokens:
        tokens += engine.tokenizer.encode(BATCH_TEXT.format(index=index), add_special_tokens=False)
        index += 1
    return tokens[:num_tokens]


def run_setting(
    engine: EngineCore, batch_ids: list[int], budget: int, priorities: bool, chat_tokens: int
) -> dict:
    # The step budget is the scheduler's plain setting; one engine serves all three settings.
    engine.scheduler.max_num_batched_tokens = budget
    chat_ids = engine.tokenizer.encode(CHAT_PROMPT)
    chat = SamplingParams(temperature=0, max_tokens=chat_tokens, ignore_eos=True)
    token_times: dict[str, list[float]] = {"chat-a": [], "chat-b": [], "batch": []}
    arrival = {"chat-a": time.monotonic()}
    engine.add_request("chat-a", chat_ids, chat, arrival["chat-a"], priority=0)
    step = 0
    while engine.has_unfinished_requests():
        if len(token_times["chat-a"]) == 3 and "batch" not in arrival:
            arrival["batch"] = time.monotonic()
            batch_priority = PRIORITY_CLASSES["batch"] if priorities else 0
            engine.add_request(
                "batch",
                batch_ids,
                SamplingParams(temperature=0, max_tokens=1),
                arrival["batch"],
                priority=batch_priority,
            )
        elif "batch" in arrival and "chat-b" not in arrival:
            arrival["chat-b"] = time.monotonic()
            engine.add_request("chat-b", chat_ids, chat, arrival["chat-b"], priority=0)
        deltas = engine.step()
        now = time.monotonic()
        step += 1
        for delta in deltas:
            if delta.request_id in token_times:
                token_times[delta.request_id].append(now)
    # Intervals that end while the batch prompt is in prefill: from its arrival to its token.
    prefill_end = token_times["batch"][0]
    itl = [
        end - start
        for name in ("chat-a", "chat-b")
        for start, end in itertools.pairwise(token_times[name])
        if arrival["batch"] < end <= prefill_end
    ]
    return {
        "budget": budget,
        "priorities": priorities,
        "steps": step,
        "itl_p50_s": statistics.median(itl),
        "itl_p95_s": percentile(itl, 95),
        "itl_max_s": max(itl),
        "itl_intervals": len(itl),
        "batch_prefill_s": prefill_end - arrival["batch"],
        "chat_b_ttft_s": token_times["chat-b"][0] - arrival["chat-b"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-tokens", type=int, default=7500)
    parser.add_argument("--chunk", type=int, default=512, help="step budget with chunked prefill")
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="auto")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = EngineCore(
        EngineConfig(
            device=args.device,
            max_model_len=8192,
            kv_cache_memory="512MiB",  # 11k float32 tokens: the prompt and both chats
            enable_prefix_caching=False,
        )
    )
    batch_ids = batch_prompt(engine, args.batch_tokens)
    settings = {
        "no chunking, no priorities": (8192, False),
        "chunked prefill, no priorities": (args.chunk, False),
        "chunked prefill + priorities": (args.chunk, True),
    }
    results = {}
    for name, (budget, priorities) in settings.items():
        results[name] = run_setting(engine, batch_ids, budget, priorities, args.chat_tokens)
        print(name, json.dumps(results[name]), flush=True)
    baseline = results["no chunking, no priorities"]["itl_p95_s"]
    report = {
        "settings": vars(args),
        "results": results,
        "itl_p95_vs_no_chunking": {
            name: baseline / result["itl_p95_s"] for name, result in results.items()
        },
    }
    report = write_json(RESULTS / "priority_itl.json", report, script_command(__file__, argv))
    write_table_and_plot(report)
    print(json.dumps(report, indent=2))
    return 0


def write_table_and_plot(report: dict) -> None:
    results = report["results"]
    lines = [
        "| setting | step budget | ITL p50 (s) | ITL p95 (s) | ITL max (s) | 2nd chat TTFT (s)"
        " | batch prefill (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {r['budget']} | {r['itl_p50_s']:.2f} | {r['itl_p95_s']:.2f}"
        f" | {r['itl_max_s']:.2f} | {r['chat_b_ttft_s']:.2f} | {r['batch_prefill_s']:.1f} |"
        for name, r in results.items()
    ]
    lines += ["", f"Command: `{report['command']}` on {report['cpu']}"]
    (RESULTS / "priority_itl.md").write_text("\n".join(lines) + "\n")
    grouped_bars(
        results,
        {"itl_p95_s": "ITL p95", "chat_b_ttft_s": "2nd chat TTFT"},
        [n.replace(", ", ",\n") for n in results],
        "seconds",
        f"Interactive latency while a {report['settings']['batch_tokens']:,}-token prompt runs",
        RESULTS / "priority_itl.png",
        figsize=(6.5, 3.5),
    )


if __name__ == "__main__":
    raise SystemExit(main())
