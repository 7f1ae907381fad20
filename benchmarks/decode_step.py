"""``python benchmarks/decode_step.py``: runs the benchmark ``llmpool.bench.decode_step`` (its docstring says what it measures)."""

from llmpool.bench.decode_step import main

if __name__ == "__main__":
    raise SystemExit(main())
