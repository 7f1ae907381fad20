"""The roof of a serving workload: the least time this machine could serve it in.

Measured in the same run as the load (issue 28 asks for the batched step "at half of the in-run
roof"): the machine's GEMM rate at the model's own projection shapes with ``GEMM_ROWS`` rows, in
the served dtype or in float32, whichever runs faster (``measure_machine``), and its memory
read bandwidth over a buffer far larger than the caches. The workload's work is counted from what the server reported for each request (prompt and output
tokens), for a Llama-shaped model read from its ``config.json``:

- **FLOPs**: ``2 x linear parameters`` per token computed (prompt and output), the LM head per
  output token, and attention's ``4 x heads x head_dim`` per layer per position attended;
- **bytes**: every forward step reads every weight once, and a level of ``R`` requests at
  concurrency ``c`` needs at least ``max(sum(outputs) / c, max(outputs))`` steps; every decoded
  token also reads its context's K and V once.

The roof is ``max(FLOPs / GEMM rate, bytes / bandwidth)``: compute and memory traffic overlapped
perfectly, prefill riding along with decode steps for free, so a lower bound on time that no
server reaches. A level's fraction of the roof is that bound over its measured duration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GEMM_ROWS = 512  # rows of the GEMMs the rate is measured at: a large batched step
# The rates are the best of this many rounds, each over fresh operands: on an Intel Xeon with AMX,
# beside an idle llama-server, one round's median GEMM rate was 292 GFLOP/s and the next's 969
# (other processes used under 1% of the CPUs in both); a roof is what the machine can do.
ROUNDS = 5
BANDWIDTH_BYTES = 512 * 1024**2  # far beyond any CPU's last-level cache
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the roof needs of a Llama-shaped model."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_folder(cls, folder: Path) -> ModelShape:
        config = json.loads((folder / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
        )

    def projections(self) -> list[tuple[int, int]]:
        """(out, in) of one layer's GEMMs: fused q/k/v, o, fused gate/up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [
            (q + 2 * kv, self.hidden),
            (self.hidden, q),
            (2 * self.intermediate, self.hidden),
            (self.hidden, self.intermediate),
        ]

    @property
    def layer_params(self) -> int:
        return self.layers * sum(out * inp for out, inp in self.projections())

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_position(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class MachineRoof:
    """The rates measured in this run, with every server idle: GEMMs at the model's shapes in
    ``gemm_dtype`` (``dtype``, or float32 where that ran faster), and reads of a buffer far
    larger than the caches."""

    dtype: str
    gemm_gflops: float
    read_gbytes_per_s: float
    gemm_dtype: str


@dataclass(frozen=True)
class WorkloadRoof:
    gflop: float
    gbytes: float
    seconds: float
    bound: str  # "compute" or "memory": which of the two sets the roof


def measure_machine(
    shape: ModelShape, dtype: str, repeats: int = 5, rounds: int = ROUNDS
) -> MachineRoof:
    """The GEMM rate at the model's projection shapes and the memory read bandwidth, each the
    best of ``rounds`` (``ROUNDS``), over operands in huge pages as the engine holds its weights
    and KV cache (``huge_pages``): in 4 KiB pages, beside idle servers, a 2-core Zen 4 VM
    measured ~210 GFLOP/s and ~33 GB/s, in huge pages ~330 and ~64, so a roof over ordinary
    pages was one the servers beat.

    A 16-bit ``dtype``'s GEMMs are timed in float32 too and the faster rate counts: the engine
    runs a batch's large GEMMs in float32 where its start-up probe finds that faster
    (``kernels/capabilities.py``; an Intel Xeon with AVX-512 BF16 and no AMX: 1.45x at 256
    rows), so the 16-bit rate alone would be a roof the server beats."""
    dtypes = [dtype] if dtype == "float32" else [dtype, "float32"]
    measured = [_measure_round(shape, dtypes, repeats) for _ in range(rounds)]
    rates = {name: max(gemm[name] for gemm, _ in measured) for name in dtypes}
    fastest = max(dtypes, key=rates.__getitem__)  # the served dtype where they tie
    return MachineRoof(dtype, rates[fastest], max(read for _, read in measured), fastest)


def _measure_round(
    shape: ModelShape, dtypes: list[str], repeats: int
) -> tuple[dict[str, float], float]:
    """One round's GEMM rate in each of ``dtypes`` (GFLOP/s) and read bandwidth (GB/s): medians
    of ``repeats``."""
    import torch

    from llmpool.bench.stats import median_seconds
    from llmpool.engine import huge_pages

    shapes = [*shape.projections(), (shape.vocab, shape.hidden)]
    flops = sum(2 * GEMM_ROWS * out * inp for out, inp in shapes)
    rates = {}
    with torch.inference_mode():
        for name in dtypes:
            torch_dtype = getattr(torch, name)
            weights = [huge_pages.zeros((out, inp), torch_dtype).normal_() for out, inp in shapes]
            inputs = {
                inp: huge_pages.zeros((GEMM_ROWS, inp), torch_dtype).normal_() for _, inp in shapes
            }
            seconds = median_seconds(
                lambda w=weights, x=inputs: [
                    torch.nn.functional.linear(x[i.shape[1]], i) for i in w
                ],
                repeats,
            )
            rates[name] = flops / seconds / 1e9
        buffer = huge_pages.zeros((BANDWIDTH_BYTES // 4,), torch.float32).fill_(1.0)
        read = median_seconds(buffer.sum, repeats)
    return rates, BANDWIDTH_BYTES / read / 1e9


def workload_roof(
    shape: ModelShape,
    machine: MachineRoof,
    requests: Sequence[tuple[int, int]],
    concurrency: int,
) -> WorkloadRoof:
    """The roof of serving ``requests`` (prompt tokens, output tokens) ``concurrency`` at a time."""
    dtype_bytes = DTYPE_BYTES[machine.dtype]
    prompt = sum(p for p, _ in requests)
    output = sum(o for _, o in requests)
    # Position t (0-based) attends t + 1 positions: a request of n tokens attends n(n+1)/2.
    attended = sum((p + o) * (p + o + 1) // 2 for p, o in requests)
    flops = (
        2 * shape.layer_params * (prompt + output)
        + 2 * shape.head_params * output
        + 4 * shape.layers * shape.heads * shape.head_dim * attended
    )
    steps = max(math.ceil(output / concurrency), max((o for _, o in requests), default=0))
    weight_bytes = (shape.layer_params + shape.head_params) * dtype_bytes
    # The k-th output token of a request reads the K and V of its p + k earlier positions.
    context_positions = sum(o * p + o * (o - 1) // 2 for p, o in requests)
    memory = steps * weight_bytes + context_positions * shape.kv_bytes_per_position(dtype_bytes)
    compute_s = flops / (machine.gemm_gflops * 1e9)
    memory_s = memory / (machine.read_gbytes_per_s * 1e9)
    return WorkloadRoof(
        gflop=flops / 1e9,
        gbytes=memory / 1e9,
        seconds=max(compute_s, memory_s),
        bound="compute" if compute_s >= memory_s else "memory",
    )


def describe(shape: ModelShape, machine: MachineRoof) -> dict[str, Any]:
    """The report's record of the roof: the rates, the model's shape and how it was computed."""
    return {
        **asdict(machine),
        "gemm_rows": GEMM_ROWS,
        "bandwidth_buffer_bytes": BANDWIDTH_BYTES,
        "model": asdict(shape),
        "method": (
            f"max(FLOPs / GEMM rate, bytes / read bandwidth), each rate the best of {ROUNDS}"
            " rounds; llmpool/bench/roof.py"
        ),
    }
