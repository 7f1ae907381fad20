"""``python benchmarks/suite_times.py``: runs ``llmpool.bench.suite_times`` (its docstring says what it measures)."""

from llmpool.bench.suite_times import main

if __name__ == "__main__":
    raise SystemExit(main())
