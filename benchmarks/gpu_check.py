"""GPU check: kernel tests on CUDA, decode attention bandwidth, engine throughput; one table.

The kernel tests and the decode and engine rows include the fp8 KV cache.

Run on a machine with one NVIDIA GPU (under 5 minutes): ``python benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_FILE = REPO_ROOT / "tests" / "test_triton_kernels.py"
TEST_WORKERS = 8

# HBM bandwidth from the vendor's data sheets, in TB/s. Names are matched in this order
# against torch.cuda.get_device_name(), so more specific names come first.
PEAK_TBPS = [
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L4", 0.3),
    ("A10G", 0.6),
    ("A10", 0.6),
    ("RTX 4090", 1.008),
]


@dataclass
class Row:
    """One line of the printed table."""

    check: str
    result: str
    reference: str = ""
    ratio: str = ""


def spec_peak_tbps(device_name: str) -> float | None:
    """The data-sheet HBM bandwidth of a GPU by name, or None for a GPU not in the table."""
    for key, tbps in PEAK_TBPS:
        if key in device_name:
            return tbps
    return None


def cuda_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn``, from CUDA events around ``iters`` calls after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def run_kernel_tests() -> Row:
    """The CPU test file, compiled for the GPU (interpreter off, device parameter cuda).

    Compiling the tests' ~40 kernel variants takes longer than running them, and Triton
    compiles one at a time per process: the tests are dealt out to several pytest processes
    so that the compiles use the host's cores.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LLMPOOL_KERNEL_TEST_DEVICE"] = "cuda"
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    started = time.perf_counter()
    collected = subprocess.run(
        [*pytest, "--collect-only", str(TEST_FILE)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    node_ids = [line for line in collected.stdout.splitlines() if "::" in line]
    if not node_ids:
        print(collected.stdout[-4000:], collected.stderr[-2000:], sep="\n", file=sys.stderr)
        return Row("kernel tests on cuda", "FAIL: no tests collected")
    workers = [
        subprocess.Popen(
            [*pytest, *node_ids[i::TEST_WORKERS]],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(min(TEST_WORKERS, len(node_ids)))
    ]
    counts: Counter[str] = Counter()
    failed = False
    for worker in workers:
        output = worker.communicate(timeout=max(1.0, 240 - (time.perf_counter() - started)))[0]
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        for number, outcome in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary):
            counts[outcome] += int(number)
        if worker.returncode != 0:
            failed = True
            print(output[-4000:], file=sys.stderr)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    return Row(
        "kernel tests on cuda",
        f"{'FAIL' if failed else 'PASS'}: {summary}",
        f"{time.perf_counter() - started:.0f} s, {len(workers)} processes",
    )


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write): what this GPU really sustains."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / seconds


def decode_bandwidth(
    num_seqs: int, context: int, reference: float, spec: float | None, fp8: bool = False
) -> Row:
    """Decode attention (one query per sequence) of a Llama-3-8B layer: 32 heads, 8 KV heads.

    ``fp8``: the cache in e4m3 with per-layer scales, half the bytes of bf16 to read.
    """
    from llmpool.engine.attention import AttentionMetadata
    from llmpool.engine.attention.triton_backend import TRITON
    from llmpool.engine.kv_cache import LayerKVCache, quantize_fp8

    heads, kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = num_seqs * blocks_per_seq
    # Scattered physical blocks, as after a while of serving.
    block_tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device="cuda"),
        block_tables=block_tables.to(torch.int32),
        max_query_len=1,
        max_seq_len=context,
        block_size=block_size,
    )
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    value_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    k_scale, v_scale = (0.05, 0.02) if fp8 else (1.0, 1.0)
    if fp8:
        key_cache, value_cache = (
            quantize_fp8(key_cache, k_scale),
            quantize_fp8(value_cache, v_scale),
        )
    query = torch.randn(num_seqs, heads, head_dim, dtype=dtype, device="cuda")
    plan = TRITON.plan(meta)
    cache = LayerKVCache(key_cache, value_cache, k_scale, v_scale)
    seconds = cuda_time(
        lambda: TRITON.paged_attention(query, cache, plan, head_dim**-0.5), iters=20
    )
    bandwidth = 2 * num_seqs * context * kv_heads * head_dim * key_cache.element_size() / seconds
    ratio = f"{bandwidth / reference:.0%} of copy"
    if spec is not None:
        ratio += f", {bandwidth / (spec * 1e12):.0%} of spec"
    return Row(
        f"decode attention 32q/8kv x 128 bf16, {'fp8' if fp8 else 'bf16'} KV,"
        f" {num_seqs} seqs x {context} tokens",
        f"{bandwidth / 1e12:.2f} TB/s ({seconds * 1e6:.0f} us)",
        f"copy {reference / 1e12:.2f} TB/s" + (f", spec {spec} TB/s" if spec else ""),
        ratio,
    )


def engine_throughput(
    prompts: list[list[int]],
    concurrencies: list[int],
    max_tokens: int,
    kv_cache_dtype: str = "auto",
) -> dict[int, float]:
    """Output tokens/s of the engine, all ``c`` requests submitted at once."""
    from llmpool.engine import LLM, SamplingParams

    llm = LLM(
        model=None,
        max_num_seqs=max(concurrencies),
        dtype="bfloat16",
        device="cuda",
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    llm.generate(prompts[: max(concurrencies)], params)  # compiles every kernel variant
    results = {}
    for concurrency in concurrencies:
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts[:concurrency], params)
        torch.cuda.synchronize()
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        results[concurrency] = tokens / (time.perf_counter() - started)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return results


def hf_generate(model: torch.nn.Module, batch: list[list[int]], max_tokens: int) -> int:
    """Generate exactly ``max_tokens`` greedy tokens per prompt; returns the tokens made."""
    input_ids = torch.tensor(batch, device="cuda")  # equal lengths: no padding needed
    pad = model.config.eos_token_id
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad[0] if isinstance(pad, list) else pad,
    )
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0]


def hf_throughput(
    folder: Path, prompts: list[list[int]], concurrencies: list[int], max_tokens: int
) -> dict[int, float]:
    """Output tokens/s of transformers' ``generate`` on the same weights, one batch of ``c``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    results = {}
    with torch.inference_mode():
        hf_generate(model, prompts[:2], max_tokens)  # warm-up
        for concurrency in concurrencies:
            torch.cuda.synchronize()
            started = time.perf_counter()
            tokens = hf_generate(model, prompts[:concurrency], max_tokens)
            torch.cuda.synchronize()
            results[concurrency] = tokens / (time.perf_counter() - started)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def throughput_rows(prompt_len: int, max_tokens: int, concurrencies: list[int]) -> list[Row]:
    from transformers import AutoConfig

    from llmpool.engine.model_source import resolve

    folder = resolve(None).folder
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(max(concurrencies))
    ]
    engine = engine_throughput(prompts, concurrencies, max_tokens)
    highest = max(concurrencies)
    fp8 = engine_throughput(prompts, [highest], max_tokens, kv_cache_dtype="fp8")[highest]
    hf = hf_throughput(folder, prompts, concurrencies, max_tokens)
    return [
        *(
            Row(
                f"built-in model, concurrency {c}, {prompt_len}+{max_tokens} tokens",
                f"llmpool {engine[c]:,.0f} tok/s",
                f"HF transformers {hf[c]:,.0f} tok/s",
                f"{engine[c] / hf[c]:.2f}x",
            )
            for c in concurrencies
        ),
        Row(
            f"built-in model, fp8 KV cache, concurrency {highest}",
            f"llmpool {fp8:,.0f} tok/s",
            f"bf16 KV {engine[highest]:,.0f} tok/s",
            f"{fp8 / engine[highest]:.2f}x",
        ),
    ]


def print_table(title: str, rows: list[Row]) -> None:
    header = Row("check", "result", "reference", "ratio")
    table = [header, *rows]
    widths = [
        max(len(getattr(r, f)) for r in table) for f in ("check", "result", "reference", "ratio")
    ]

    def line(row: Row) -> str:
        cells = (row.check, row.result, row.reference, row.ratio)
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    print(f"\n{title}\n")
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-tests", action="store_true", help="only measure")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to measure", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    rows = [] if args.skip_tests else [run_kernel_tests()]
    reference, spec = copy_bandwidth(), spec_peak_tbps(name)
    rows.append(decode_bandwidth(64, 2048, reference, spec))
    rows.append(decode_bandwidth(8, 8192, reference, spec))
    rows.append(decode_bandwidth(64, 2048, reference, spec, fp8=True))
    rows.extend(throughput_rows(args.prompt_len, args.max_tokens, [1, 16, 64]))
    print_table(f"llmpool GPU check on {name} (torch {torch.__version__})", rows)
    return 1 if rows[0].result.startswith("FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())
