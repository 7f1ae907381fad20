"""``python benchmarks/gateway_routing.py``: runs the benchmark ``llmpool.bench.gateway_routing`` (its docstring says what it measures)."""

from llmpool.bench.gateway_routing import main

if __name__ == "__main__":
    raise SystemExit(main())
