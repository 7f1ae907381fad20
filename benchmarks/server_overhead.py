"""``python benchmarks/server_overhead.py``: runs the benchmark ``llmpool.bench.server_overhead`` (its docstring says what it measures)."""

from llmpool.bench.server_overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
