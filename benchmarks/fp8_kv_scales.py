"""``python benchmarks/fp8_kv_scales.py``: runs the benchmark ``llmpool.bench.fp8_kv_scales`` (its docstring says what it measures)."""

from llmpool.bench.fp8_kv_scales import main

if __name__ == "__main__":
    raise SystemExit(main())
