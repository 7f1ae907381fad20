"""``python benchmarks/spec_decode.py``: runs the benchmark ``llmpool.bench.spec_decode`` (its docstring says what it measures)."""

from llmpool.bench.spec_decode import main

if __name__ == "__main__":
    raise SystemExit(main())
