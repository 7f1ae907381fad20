"""The vLLM-named load gauges that routers read (Gateway API Inference Extension) equal ours."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmpool.engine.engine_core import EngineStats
from llmpool.engine.server.metrics import INTEROP_GAUGES, EngineMetrics

MODEL = "smollm2"


def samples(metrics: EngineMetrics) -> dict[tuple[str, str], float]:
    """``(name, model_name label) -> value`` of every gauge sample rendered."""
    text = metrics.render().decode()
    return {
        (sample.name, sample.labels.get("model_name", "")): sample.value
        for family in text_string_to_metric_families(text)
        if family.type == "gauge"
        for sample in family.samples
    }


def stats(running: int, waiting: int, usage: float) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=usage,
        num_free_blocks=10,
        num_total_blocks=40,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )


def test_interop_gauges_exist_at_zero_on_a_fresh_engine() -> None:
    values = samples(EngineMetrics(MODEL))
    for name in INTEROP_GAUGES:
        assert values[(f"vllm:{name}", MODEL)] == 0
        assert values[(f"llmpool:{name}", MODEL)] == 0


def test_interop_gauges_follow_every_stats_update() -> None:
    metrics = EngineMetrics(MODEL)
    for running, waiting, usage in ((3, 5, 0.75), (1, 0, 0.125), (0, 0, 0.0)):
        metrics.on_stats(stats(running, waiting, usage))
        values = samples(metrics)
        expected = {
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_cache_usage_perc": usage,
        }
        for name in INTEROP_GAUGES:
            assert values[(f"vllm:{name}", MODEL)] == expected[name], name
            assert values[(f"llmpool:{name}", MODEL)] == expected[name], name


def test_only_the_three_router_gauges_use_vllm_names() -> None:
    """Everything else stays under our prefix: two copies of every metric would be noise."""
    names = {name for name, _ in samples(EngineMetrics(MODEL))}
    assert {n for n in names if n.startswith("vllm:")} == {f"vllm:{n}" for n in INTEROP_GAUGES}
