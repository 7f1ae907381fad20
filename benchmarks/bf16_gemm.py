"""``python benchmarks/bf16_gemm.py``: runs the benchmark ``llmpool.bench.bf16_gemm`` (its docstring says what it measures)."""

from llmpool.bench.bf16_gemm import main

if __name__ == "__main__":
    raise SystemExit(main())
