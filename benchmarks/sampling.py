"""``python benchmarks/sampling.py``: runs the benchmark ``llmpool.bench.sampling`` (its docstring says what it measures)."""

from llmpool.bench.sampling import main

if __name__ == "__main__":
    raise SystemExit(main())
