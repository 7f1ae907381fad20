"""Decode steps in one C call (``cpu_decoder.c``) against the same kernels called layer by layer.

One engine (``--dtype``, default auto: bfloat16 where the CPU has AVX-512 BF16; and
``--quantization``) whose decode steps run in its C decoder or, with ``model.cpu_decoder``
unset, layer by layer through torch and ctypes; rounds of steps alternate between the two at
each concurrency (decodes only; the C decoder takes up to as many rows as the engine's C GEMM is
chosen for: 16 by default, 2 in int4).

    python benchmarks/cpu_decoder.py --concurrency 1 4 16
    python benchmarks/cpu_decoder.py --quantization int4 --concurrency 1 2 --name cpu_decoder_int4

Writes ``benchmarks/results/cpu_decoder.json`` with the CPU model.
"""

from __future__ import annotations

import torch

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.steps import alternate_steps, engine_for_alternating


def main() -> None:
    args, llm = engine_for_alternating(__doc__.split("\n")[0], "cpu_decoder", [1, 4, 16])
    model = llm.engine.model
    decoder = model.cpu_decoder
    if decoder is None:
        raise SystemExit(f"the C decoder does not run here ({args.dtype}: no C GEMM chosen?)")
    if max(args.concurrency) > decoder.max_rows:
        raise SystemExit(f"the C decoder takes up to {decoder.max_rows} decodes here")
    report = {
        "threads": torch.get_num_threads(),
        "dtype": str(model.norm.dtype),
        "quantization": args.quantization,
        "max_rows": decoder.max_rows,
        "step": alternate_steps(
            llm,
            args.concurrency,
            args.rounds,
            {
                "c_decoder": lambda: setattr(model, "cpu_decoder", decoder),
                "layer_by_layer": lambda: setattr(model, "cpu_decoder", None),
            },
        ),
    }
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
