"""``python benchmarks/priority_itl.py``: runs the benchmark ``llmpool.bench.priority_itl`` (its docstring says what it measures)."""

from llmpool.bench.priority_itl import main

if __name__ == "__main__":
    raise SystemExit(main())
