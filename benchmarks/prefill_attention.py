"""``python benchmarks/prefill_attention.py``: runs the benchmark ``llmpool.bench.prefill_attention`` (its docstring says what it measures)."""

from llmpool.bench.prefill_attention import main

if __name__ == "__main__":
    raise SystemExit(main())
