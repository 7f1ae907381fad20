"""``python benchmarks/vnni_gemm.py``: runs the benchmark ``llmpool.bench.vnni_gemm`` (its docstring says what it measures)."""

from llmpool.bench.vnni_gemm import main

if __name__ == "__main__":
    raise SystemExit(main())
