"""``python benchmarks/prefix_cache.py``: runs the benchmark ``llmpool.bench.prefix_cache`` (its docstring says what it measures)."""

from llmpool.bench.prefix_cache import main

if __name__ == "__main__":
    raise SystemExit(main())
