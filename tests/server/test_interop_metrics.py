"""The vLLM-named load gauges that routers read (Gateway API Inference Extension) equal ours."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmpool.engine.engine_core import EngineStats
from llmpool.engine.outputs import RequestDelta
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


def stats(
    running: int,
    waiting: int,
    usage: float,
    running_adapters: tuple[str, ...] = (),
    waiting_adapters: tuple[str, ...] = (),
) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=waiting, kv_cache_usage=usage, num_free_blocks=10,
        num_total_blocks=40, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
        running_adapters=running_adapters, waiting_adapters=waiting_adapters,
    )  # fmt: skip


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
    """Everything else stays under our prefix: two copies of every metric would be noise (with
    LoRA on, vLLM's lora_requests_info joins them: see below)."""
    names = {name for name, _ in samples(EngineMetrics(MODEL))}
    assert {n for n in names if n.startswith("vllm:")} == {f"vllm:{n}" for n in INTEROP_GAUGES}


def lora_info(metrics: EngineMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of both lora_requests_info families, by prefix."""
    text = metrics.render().decode()
    return {
        family.name.split(":")[0]: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
        if family.name.endswith(":lora_requests_info")
    }


def test_lora_metrics_exist_only_with_lora() -> None:
    assert lora_info(EngineMetrics(MODEL)) == {}
    names = {name for name, _ in samples(EngineMetrics(MODEL, max_loras=4))}
    assert {n for n in names if n.startswith("vllm:")} == {
        *(f"vllm:{n}" for n in INTEROP_GAUGES),
        "vllm:lora_requests_info",
    }


def test_lora_requests_info_is_one_series_naming_the_adapters() -> None:
    metrics = EngineMetrics(MODEL, max_loras=4)
    empty = {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    first = lora_info(metrics)
    assert [labels for labels, _ in first["vllm"]] == [{"model_name": MODEL, **empty}]
    metrics.on_stats(stats(3, 1, 0.5, ("beta", "alpha"), ("gamma",)))
    changed = lora_info(metrics)
    for prefix in ("vllm", "llmpool"):
        [(labels, value)] = changed[prefix]
        assert labels == {
            "model_name": MODEL, "max_lora": "4", "running_lora_adapters": "alpha,beta",
            "waiting_lora_adapters": "gamma",
        }  # fmt: skip
        assert value >= first[prefix][0][1]
    metrics.on_stats(stats(3, 1, 0.5, ("alpha", "beta"), ("gamma",)))
    assert lora_info(metrics) == changed  # the same adapters: the time of the change stays
    metrics.on_stats(stats(0, 0, 0.0))
    assert [labels for labels, _ in lora_info(metrics)["llmpool"]] == [
        {"model_name": MODEL, **empty}
    ]


def test_lora_counters_are_per_adapter_and_leave_the_base_out() -> None:
    metrics = EngineMetrics(MODEL, max_loras=2)
    first = RequestDelta("r", [1, 2], "ab", num_prompt_tokens=5)
    metrics.on_tokens(first, True, 0.1, "alpha")
    metrics.on_tokens(RequestDelta("r", [3], "c"), False, 0.1, "alpha")
    metrics.on_finished("stop", 0.3, "alpha")
    metrics.on_tokens(RequestDelta("s", [4], "d", num_prompt_tokens=9), True, 0.1)
    metrics.on_finished("stop", 0.2)
    text = metrics.render().decode()
    values = {
        (sample.name, sample.labels.get("lora_name")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("llmpool:lora_") and family.type == "counter"
        for sample in family.samples
    }
    assert values == {
        ("llmpool:lora_requests_total", "alpha"): 1,
        ("llmpool:lora_prompt_tokens_total", "alpha"): 5,
        ("llmpool:lora_generation_tokens_total", "alpha"): 3,
    }
