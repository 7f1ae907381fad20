"""Targets of one `llmpool bench serve` run (ours and ``--against`` peers) and their ratios.

Every ratio is ours / peer at the same concurrency level, measured on the same requests in the
same run: output tok/s above 1 means we are faster, ITL p50 and TTFT p50 below 1 mean we are.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Target:
    name: str
    url: str


def parse_target(spec: str, default_name: str | None = None) -> Target:
    """``URL`` or ``NAME=URL``; a bare URL is named ``default_name``, else by its host:port."""
    name, equals, url = spec.partition("=")
    if not equals or "://" in name:
        name, url = default_name or "", spec
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected URL or NAME=URL with an http(s) URL: {spec!r}")
    return Target(name or parts.netloc, url.rstrip("/"))


def check_unique(targets: list[Target]) -> None:
    names = [target.name for target in targets]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"target names must differ (name them NAME=URL): {', '.join(duplicates)}")


def ratio(ours: float, peer: float) -> float:
    return ours / peer if peer and math.isfinite(peer) else math.nan


@dataclass
class LevelRatios:
    concurrency: int
    output_throughput_ratio: float
    itl_p50_ratio: float
    ttft_p50_ratio: float


def level_ratios(ours: dict[str, Any], peer: dict[str, Any]) -> LevelRatios:
    """Ratios of two `LevelSummary` dicts (as in the JSON report) at one concurrency."""
    if ours["concurrency"] != peer["concurrency"]:
        raise ValueError(f"levels differ: {ours['concurrency']} vs {peer['concurrency']}")
    return LevelRatios(
        concurrency=ours["concurrency"],
        output_throughput_ratio=ratio(ours["output_throughput"], peer["output_throughput"]),
        itl_p50_ratio=ratio(ours["itl_ms"]["p50"], peer["itl_ms"]["p50"]),
        ttft_p50_ratio=ratio(ours["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]),
    )


def comparison_table(
    ours_name: str, ours: list[dict[str, Any]], peer_name: str, peer: list[dict[str, Any]]
) -> str:
    """Markdown: both targets' tok/s, ITL p50 and TTFT p50 per level, and ours / peer."""
    lines = [
        f"| concurrency | output tok/s {ours_name} / {peer_name} (ratio)"
        f" | ITL p50 ms {ours_name} / {peer_name} (ratio)"
        f" | TTFT p50 ms {ours_name} / {peer_name} (ratio) |",
        "|---:|---:|---:|---:|",
    ]
    for mine, theirs in zip(ours, peer, strict=True):
        ratios = level_ratios(mine, theirs)
        lines.append(
            f"| {ratios.concurrency}"
            f" | {mine['output_throughput']:.1f} / {theirs['output_throughput']:.1f}"
            f" ({ratios.output_throughput_ratio:.2f}x)"
            f" | {mine['itl_ms']['p50']:,.1f} / {theirs['itl_ms']['p50']:,.1f}"
            f" ({ratios.itl_p50_ratio:.2f}x)"
            f" | {mine['ttft_ms']['p50']:,.0f} / {theirs['ttft_ms']['p50']:,.0f}"
            f" ({ratios.ttft_p50_ratio:.2f}x) |"
        )
    return "\n".join(lines) + "\n"
