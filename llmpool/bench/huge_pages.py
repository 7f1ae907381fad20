"""Decode steps with the weights in huge pages (as the engine loads them) against the same
weights in ordinary memory (``huge_pages.py``'s why).

One engine (``--dtype``, default auto, and ``--quantization``); its weights are copied once more
into torch's own CPU memory (glibc's malloc: 4 KiB pages where THP is in ``madvise`` mode), and
rounds of steps alternate between the two copies at each concurrency (decodes only; the C
decoder is rebuilt over each copy). The KV cache stays in huge pages throughout. The report
gives how many bytes of each copy the kernel backs with huge pages.

    python benchmarks/huge_pages.py --concurrency 1 4 16 64

Writes ``benchmarks/results/huge_pages.json`` with the CPU model and the THP mode.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.steps import alternate_steps, engine_for_alternating
from llmpool.engine import huge_pages
from llmpool.engine.kernels import cpu_decoder
from llmpool.engine.models.llama import LlamaForCausalLM

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (tied ones once)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def place(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Point every parameter and buffer of ``model`` at its tensor in ``tensors``."""
    for name, parameter in model.named_parameters():
        parameter.data = tensors[name]
    for name, _ in model.named_buffers():
        owner, _, attribute = name.rpartition(".")
        model.get_submodule(owner).register_buffer(attribute, tensors[name])


def main() -> None:
    args, llm = engine_for_alternating(__doc__.split("\n")[0], "huge_pages", [1, 4, 16, 64])
    core = llm.engine
    model = core.model
    huge = {name: tensor.data for name, tensor in weights(model).items()}
    plain = {name: tensor.clone() for name, tensor in huge.items()}

    def use(tensors: dict[str, torch.Tensor]) -> None:
        place(model, tensors)
        model.cpu_decoder = cpu_decoder.for_model(model, core.kernels)

    report = {
        "threads": torch.get_num_threads(),
        "thp": THP_MODE.read_text().strip() if THP_MODE.exists() else None,
        "dtype": str(model.norm.dtype),
        "quantization": args.quantization,
        "weights": huge_pages.observed(huge.values()),
        "weights_ordinary": huge_pages.observed(plain.values()),
        "step": alternate_steps(
            llm,
            args.concurrency,
            args.rounds,
            {"huge_pages": lambda: use(huge), "ordinary_pages": lambda: use(plain)},
        ),
    }
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))
