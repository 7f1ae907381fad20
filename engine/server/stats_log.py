"""The periodic engine stats log line: throughput, queue lengths, KV usage, prefix-cache hit rate."""

from __future__ import annotations

import asyncio
import logging
import time

from llmpool.engine.server.metrics import EngineMetrics, Totals

logger = logging.getLogger(__name__)


def stats_line(previous: Totals, current: Totals, seconds: float) -> str:
    prompt_rate = (current.prompt_tokens - previous.prompt_tokens) / seconds
    generation_rate = (current.generation_tokens - previous.generation_tokens) / seconds
    queries = current.engine.prefix_cache_queries - previous.engine.prefix_cache_queries
    hits = current.engine.prefix_cache_hits - previous.engine.prefix_cache_hits
    hit_rate = f"{100 * hits / queries:.1f}%" if queries else "n/a"
    return (
        f"engine: prompt {prompt_rate:.1f} tok/s, generation {generation_rate:.1f} tok/s,"
        f" running {current.engine.num_running}, waiting {current.engine.num_waiting},"
        f" KV usage {100 * current.engine.kv_cache_usage:.1f}%, prefix cache hit rate {hit_rate}"
    )


def _idle(previous: Totals, current: Totals) -> bool:
    return (
        current.engine.num_running == current.engine.num_waiting == 0
        and current.generation_tokens == previous.generation_tokens
        and current.prompt_tokens == previous.prompt_tokens
    )


async def log_stats_forever(metrics: EngineMetrics, interval: float) -> None:
    """One line every ``interval`` seconds; an idle engine logs once, not every interval."""
    previous, previous_time = metrics.snapshot(), time.monotonic()
    was_idle = False
    while True:
        await asyncio.sleep(interval)
        current, now = metrics.snapshot(), time.monotonic()
        idle = _idle(previous, current)
        if not (idle and was_idle):
            logger.info("%s", stats_line(previous, current, now - previous_time))
        was_idle = idle
        previous, previous_time = current, now
