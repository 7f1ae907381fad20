"""``python benchmarks/grammar_isolation.py``: runs the benchmark ``llmpool.bench.grammar_isolation`` (its docstring says what it measures)."""

from llmpool.bench.grammar_isolation import main

if __name__ == "__main__":
    raise SystemExit(main())
