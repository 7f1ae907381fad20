"""``python benchmarks/structured_outputs.py``: runs the benchmark ``llmpool.bench.structured_outputs`` (its docstring says what it measures)."""

from llmpool.bench.structured_outputs import main

if __name__ == "__main__":
    raise SystemExit(main())
