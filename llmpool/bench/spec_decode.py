"""Prompt-lookup speculative decoding: tok/s and per-token latency with and without drafts.

One process, two engines with the same settings but ``--speculative-config`` (the built-in model,
greedy, so both produce the same tokens: the check is part of the run). Workloads: extraction
(quote a passage), code edit (rename a variable, output the whole code), and random words (the
`llmpool bench serve` workload, where little repeats); each at batch 1 (requests one after
another) and at a larger batch (all at once). TPOT is a request's time from its first token to
its last, over its tokens after the first; p50 over the requests.

    python benchmarks/spec_decode.py --requests 4 --batch-sizes 1,16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import script_command, write_report
from llmpool.bench.workload import WORDS
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.sampling_params import SamplingParams

PASSAGES = [
    "The museum opens at nine on weekdays and at ten on weekends. Guided tours start every hour"
    " from the main hall, and tickets bought online include the special exhibition on the"
    " second floor.",
    "To reset the router, hold the small button on the back for ten seconds until the lights"
    " flash, then wait two minutes and connect again with the password printed on the label.",
    "The committee approved the budget for the new bridge, asked the city engineer for a safety"
    " report by March, and postponed the vote on the parking plan to the next meeting.",
    "Water the tomatoes in the morning, keep the soil moist but not wet, and pick the fruit when"
    " it is deep red and slightly soft to the touch.",
]
CODE = """def summarize(orders, threshold):
    count = 0
    total = 0.0
    for order in orders:
        if order.amount > threshold:
            count += 1
            total += order.amount
    average = total / count if count else 0.0
    return {"count": count, "total": total, "average": average}
"""
CODE_RENAMES = [
    ("count", "num_large"),
    ("total", "large_sum"),
    ("order", "item"),
    ("orders", "rows"),
]


def workload(engine: EngineCore, name: str, count: int, seed: int) -> list[list[int]]:
    """``count`` chat prompts of workload ``name``, as token ids."""
    rng = random.Random(seed)
    texts = []
    for index in range(count):
        if name == "extraction":
            passage = PASSAGES[index % len(PASSAGES)]
            texts.append(f"Repeat the following passage exactly, word for word:\n\n{passage}")
        elif name == "code_edit":
            old, new = CODE_RENAMES[index % len(CODE_RENAMES)]
            texts.append(
                f"Rename the variable `{old}` to `{new}` in this Python code and output the"
                f" full code:\n\n```python\n{CODE}```"
            )
        else:
            texts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(32, 512))))
    tokenizer = engine.tokenizer
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in texts
    ]
    return [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]


def run(engine: EngineCore, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Requests in waves of ``batch``; returns tokens, wall time, TPOT p50 and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = engine.stats()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for wave in range(0, len(prompts), batch):
        for index in range(wave, min(wave + batch, len(prompts))):
            engine.add_request(str(index), prompts[index], params)
            outputs[str(index)] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                now = time.perf_counter()
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
                outputs[delta.request_id] += delta.new_token_ids
    wall = time.perf_counter() - started
    after = engine.stats()
    tpot = [
        (last[rid] - first[rid]) / (len(tokens) - 1)
        for rid, tokens in outputs.items()
        if len(tokens) > 1
    ]
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {
        "output_tokens": sum(map(len, outputs.values())),
        "wall_s": wall,
        "tok_s": sum(map(len, outputs.values())) / wall,
        "tpot_p50_ms": 1000 * statistics.median(tpot),
        "draft_tokens": draft_tokens,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "outputs": [outputs[str(i)] for i in range(len(prompts))],
    }


def compare(engines: dict[str, EngineCore], args: argparse.Namespace) -> list[dict]:
    rows = []
    for name in args.workloads.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            count = max(args.requests, batch)
            prompts = workload(engines["off"], name, count, args.seed)
            off = run(engines["off"], prompts, batch, args.max_tokens)
            on = run(engines["on"], prompts, batch, args.max_tokens)
            row = {
                "workload": name,
                "batch": batch,
                "requests": count,
                "same_outputs": off.pop("outputs") == on.pop("outputs"),
                "off": off,
                "on": on,
                "tok_s_ratio": on["tok_s"] / off["tok_s"],
                "tpot_ratio": on["tpot_p50_ms"] / off["tpot_p50_ms"],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(report: dict) -> str:
    lines = [
        "| workload | batch | tok/s off | tok/s on | tok/s on/off | TPOT p50 off (ms) |"
        " TPOT p50 on (ms) | TPOT on/off | acceptance | same output |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["results"]:
        off, on = row["off"], row["on"]
        rate = on["acceptance_rate"]
        lines.append(
            f"| {row['workload']} | {row['batch']} | {off['tok_s']:.1f} | {on['tok_s']:.1f} |"
            f" {row['tok_s_ratio']:.2f}x | {off['tpot_p50_ms']:.1f} | {on['tpot_p50_ms']:.1f} |"
            f" {row['tpot_ratio']:.2f}x | {'-' if rate is None else f'{100 * rate:.0f}%'} |"
            f" {'yes' if row['same_outputs'] else 'NO'} |"
        )
    lines.append(f"\nCommand: `{report['command']}` on {report['cpu']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="extraction,code_edit,random")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--requests", type=int, default=4, help="at least; a batch's size if more")
    parser.add_argument("--max-tokens", type=int, default=96)
    # Drafts at every batch size, so that the larger batch measures what speculation does there.
    parser.add_argument(
        "--speculative-config", default='{"method": "ngram", "disable_by_batch_size": null}'
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {
        setting: build_in_ended_thread(
            lambda speculative=speculative: EngineCore(
                EngineConfig(
                    dtype=args.dtype,
                    max_model_len=2048,
                    kv_cache_memory="512MiB",
                    speculative_config=speculative,
                )
            )
        )
        for setting, speculative in (("off", None), ("on", args.speculative_config))
    }
    report = {"settings": vars(args), "results": compare(engines, args)}
    write_report("spec_decode", report, script_command(__file__, argv), table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
