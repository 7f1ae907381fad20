"""``python benchmarks/avx2_gemm.py``: runs the benchmark ``llmpool.bench.avx2_gemm`` (its docstring says what it measures)."""

from llmpool.bench.avx2_gemm import main

if __name__ == "__main__":
    raise SystemExit(main())
