"""``python benchmarks/quantized_linear.py``: runs the benchmark ``llmpool.bench.quantized_linear`` (its docstring says what it measures)."""

from llmpool.bench.quantized_linear import main

if __name__ == "__main__":
    raise SystemExit(main())
