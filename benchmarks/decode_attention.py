"""``python benchmarks/decode_attention.py``: runs the benchmark ``llmpool.bench.decode_attention`` (its docstring says what it measures)."""

from llmpool.bench.decode_attention import main

if __name__ == "__main__":
    raise SystemExit(main())
