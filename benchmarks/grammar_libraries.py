"""``python benchmarks/grammar_libraries.py``: runs the benchmark ``llmpool.bench.grammar_libraries`` (its docstring says what it measures)."""

from llmpool.bench.grammar_libraries import main

if __name__ == "__main__":
    raise SystemExit(main())
