"""``python benchmarks/huge_pages.py``: runs the benchmark ``llmpool.bench.huge_pages`` (its docstring says what it measures)."""

from llmpool.bench.huge_pages import main

if __name__ == "__main__":
    raise SystemExit(main())
