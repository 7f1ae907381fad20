"""`llmpool bench offline`: llmpool vs HF transformers static batching, same workload, same process.

The workload (issue 2): N requests with prompt lengths and output lengths drawn with a fixed
seed, all arriving at once. HF takes them in arrival order in batches of the concurrency and runs
each batch until its longest request is done; llmpool runs with ``max_num_seqs`` equal to the
concurrency, on a fresh engine per level: an engine kept across levels would find the workload's
prompts in its prefix cache from the level before, while HF computes them every time. Only
requested output tokens count for both.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from llmpool.bench.results import write_json
from llmpool.engine import LLM, SamplingParams, model_source
from llmpool.engine.cpu_features import cpu_model
from llmpool.engine.lora import LoRARequest
from llmpool.engine.model_runner import StepTimings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def requested_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    dtype: str
    concurrency: int
    hf_tokens_per_s: float
    llmpool_tokens_per_s: float
    ratio: float
    llmpool_step_breakdown: dict[str, float]
    python_overhead_fraction: float
    # Prompt tokens of this level found in / looked up in llmpool's prefix cache: each level runs
    # on a fresh engine, so the hits are the workload's own sharing (none for random prompts).
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    load_average: float  # the machine's 1-minute load average when the level finished


@dataclass(frozen=True)
class LlmpoolRun:
    tokens_per_s: float
    elapsed: float
    timings: StepTimings
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int


def make_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    # Token ids well inside the vocabulary, avoiding the special tokens at the start.
    prompts = [rng.integers(100, vocab_size, int(n)).tolist() for n in prompt_lens]
    return Workload(prompts=prompts, output_lens=[int(n) for n in output_lens])


def run_hf(
    model: torch.nn.Module, workload: Workload, concurrency: int, pad_token_id: int
) -> float:
    """Output tokens/s of static batches: left-padded prompts, run to the batch's longest output."""
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(workload.prompts), concurrency):
            batch = workload.prompts[start : start + concurrency]
            longest_output = max(workload.output_lens[start : start + concurrency])
            width = max(map(len, batch))
            input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, prompt in enumerate(batch):
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
                attention_mask[row, width - len(prompt) :] = 1
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=longest_output,
                min_new_tokens=longest_output,
                do_sample=False,
                pad_token_id=pad_token_id,
            )
    return workload.requested_tokens / (time.perf_counter() - started)


def run_llmpool(
    llm: LLM,
    workload: Workload,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
) -> LlmpoolRun:
    """The workload in one ``generate``; ``lora_request`` as ``LLM.generate`` takes it."""
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    llm.engine.runner.timings = StepTimings()
    before = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, lora_request=lora_request)
    elapsed = time.perf_counter() - started
    after = llm.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.requested_tokens, (produced, workload.requested_tokens)
    return LlmpoolRun(
        tokens_per_s=produced / elapsed,
        elapsed=elapsed,
        timings=llm.engine.runner.timings,
        prefix_cache_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
        prefix_cache_query_tokens=after.prefix_cache_queries - before.prefix_cache_queries,
    )


def breakdown(timings: StepTimings, elapsed: float) -> tuple[dict[str, float], float]:
    """Milliseconds per step in each phase, and the host-side share of the wall time.

    ``other`` is the wall time no phase covers: queuing the requests and ``LLM.generate``'s own
    loop. Everything but the forward pass and sampling is host-side Python overhead.
    """
    steps = max(timings.steps, 1)
    phases = {
        "schedule": timings.schedule,
        "prepare_inputs": timings.prepare_inputs,
        "forward": timings.forward,
        "sample": timings.sample,
        "process_outputs": timings.process_outputs,
    }
    phases["other"] = max(elapsed - sum(phases.values()), 0.0)
    per_step = {name: 1000 * seconds / steps for name, seconds in phases.items()}
    per_step["steps"] = timings.steps
    host = phases["schedule"] + phases["prepare_inputs"] + phases["process_outputs"]
    return per_step, (host + phases["other"]) / elapsed if elapsed else 0.0


def run_level(
    args: argparse.Namespace, dtype: str, concurrency: int, workload: Workload, warmup: Workload
) -> LlmpoolRun:
    """The workload on a fresh engine, so no level reuses another level's prompts from the cache."""
    llm = LLM(args.model, dtype=dtype, max_num_seqs=concurrency, max_model_len=1024)
    try:
        run_llmpool(llm, warmup)
        return run_llmpool(llm, workload)
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> Iterator[Result]:
    """One result per dtype and concurrency level, as each finishes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = model_source.resolve(args.model).folder
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    prompt_range = tuple(args.prompt_len)
    workload = make_workload(
        args.num_requests, prompt_range, tuple(args.output_len), vocab_size, args.seed
    )
    # Its own random prompts: warming up on the workload's would put them in the prefix cache.
    warmup = make_workload(2, prompt_range, (4, 4), vocab_size, args.seed + 1)
    pad = AutoTokenizer.from_pretrained(folder).pad_token_id or 0
    for dtype in args.dtypes:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        run_hf(hf, warmup, 2, pad)
        for concurrency in tqdm(args.concurrency, desc=f"bench offline {dtype}", unit="level"):
            hf_rate = run_hf(hf, workload, concurrency, pad)
            llmpool = run_level(args, dtype, concurrency, workload, warmup)
            per_step, overhead = breakdown(llmpool.timings, llmpool.elapsed)
            result = Result(
                dtype,
                concurrency,
                hf_rate,
                llmpool.tokens_per_s,
                llmpool.tokens_per_s / hf_rate,
                per_step,
                overhead,
                llmpool.prefix_cache_hit_tokens,
                llmpool.prefix_cache_query_tokens,
                os.getloadavg()[0],
            )
            logger.info("%s", result)
            yield result
        del hf
        gc.collect()


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| dtype | concurrency | HF tok/s | llmpool tok/s | ratio"
        " | ms/step: schedule / prepare / forward / sample / outputs / other | Python overhead"
        " | prefix-cache hit tokens | load average |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in sorted(results, key=lambda r: (r.dtype, r.concurrency)):
        b = r.llmpool_step_breakdown
        lines.append(
            f"| {r.dtype} | {r.concurrency} | {r.hf_tokens_per_s:.1f} | {r.llmpool_tokens_per_s:.1f} |"
            f" {r.ratio:.2f}x | {b['schedule']:.2f} / {b['prepare_inputs']:.2f} / {b['forward']:.1f} /"
            f" {b['sample']:.2f} / {b['process_outputs']:.2f} / {b['other']:.2f} |"
            f" {100 * r.python_overhead_fraction:.1f}% |"
            f" {r.prefix_cache_hit_tokens:,} of {r.prefix_cache_query_tokens:,} | {r.load_average:.1f} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r.dtype for r in results})
    figure, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for axis, dtype in zip(axes[0], dtypes, strict=True):
        rows = sorted((r for r in results if r.dtype == dtype), key=lambda r: r.concurrency)
        levels = [r.concurrency for r in rows]
        axis.plot(levels, [r.hf_tokens_per_s for r in rows], "o-", label="HF static batches")
        axis.plot(levels, [r.llmpool_tokens_per_s for r in rows], "o-", label="llmpool")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("max concurrency")
        axis.set_ylabel("output tokens/s")
        axis.set_title(f"offline throughput, {dtype}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmpool bench offline", description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder; default: the built-in model")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64]
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/offline"))
    return parser.parse_args(argv)


def write_results(results: list[Result], out: Path, argv: list[str]) -> None:
    """JSON, markdown table and plot of the results so far."""
    command = shlex.join(["llmpool", "bench", "offline", *argv])
    threads = torch.get_num_threads()
    report = {"torch_threads": threads, "results": [asdict(r) for r in results]}
    write_json(out / "results.json", report, command)
    table = markdown_table(results)
    header = f"`{command}` — {cpu_model()}, {os.cpu_count()} CPUs, torch threads: {threads}\n\n"
    (out / "results.md").write_text(header + table + "\n")
    plot(results, out / "throughput.png")


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(argv)
    results: list[Result] = []
    for result in run(args):
        # Written after every level, so an interrupted run keeps what it measured.
        results.append(result)
        write_results(results, args.out, argv)
    print(markdown_table(results))
    return 0
