"""``python benchmarks/compile_cache.py``: runs the benchmark ``llmpool.bench.compile_cache`` (its docstring says what it measures)."""

from llmpool.bench.compile_cache import main

if __name__ == "__main__":
    raise SystemExit(main())
