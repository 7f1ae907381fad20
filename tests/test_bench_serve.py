"""`llmpool bench serve`: its arguments, portable workload, chunk counting and multi-target report."""

from __future__ import annotations

import argparse
import math

import pytest

from llmpool.bench.compare import Target, comparison_table, level_ratios, parse_target
from llmpool.bench.serve import (
    LevelSummary,
    RequestResult,
    build_report,
    parse_args,
    plan_levels,
    read_chunk,
    report_markdown,
    summarize,
)
from llmpool.bench.workload import WORDS, LengthRange, make_levels, parse_length_range


def test_our_url_and_repeatable_named_peers() -> None:
    args = parse_args(
        [
            "--url", "http://127.0.0.1:8000/",
            "--against", "llama.cpp=http://127.0.0.1:8081",
            "--against", "http://10.0.0.2:9000",
        ]
    )  # fmt: skip
    assert args.url == Target("llmpool", "http://127.0.0.1:8000")
    assert args.against == [
        Target("llama.cpp", "http://127.0.0.1:8081"),
        Target("10.0.0.2:9000", "http://10.0.0.2:9000"),
    ]
    assert parse_args([]).against == []
    assert parse_args(["--url", "mine=http://h:1"]).url == Target("mine", "http://h:1")


def test_an_equals_sign_inside_a_url_is_not_a_name() -> None:
    assert parse_target("http://h:1/?a=b") == Target("h:1", "http://h:1/?a=b")


@pytest.mark.parametrize("spec", ["h:1", "peer=ftp://h", "peer=", "http://"])
def test_a_target_needs_an_http_url(spec: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_target(spec)


def test_target_names_must_differ(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--against", "http://h:1", "--against", "https://h:1"])
    assert "h:1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--against", "llmpool=http://h:2"])


def test_lengths_are_a_number_or_a_range() -> None:
    args = parse_args(["--input-len", "32-512", "--output-len", "16"])
    assert args.input_len == LengthRange(32, 512)
    assert args.output_len == LengthRange(16, 16)
    assert str(args.input_len) == "32-512" and str(args.output_len) == "16"
    for bad in ("0", "8-4", "x", "1-2-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_length_range(bad)


def test_every_level_gets_fresh_word_prompts_and_is_reproducible() -> None:
    sizes = [8, 16]
    warmup, levels = make_levels(sizes, LengthRange(32, 512), LengthRange(16, 256), 0, seed=0)
    assert [len(level) for level in levels] == sizes
    items = [item for level in levels for item in level]
    assert all(32 <= len(item.prompt.split()) <= 512 for item in items)
    assert all(16 <= item.output_len <= 256 for item in items)
    assert {word for item in items for word in item.prompt.split()} <= set(WORDS)
    assert len({item.prompt for item in items}) == len(items)
    assert warmup.output_len == 2
    assert make_levels(sizes, LengthRange(32, 512), LengthRange(16, 256), 0, seed=0) == (
        warmup,
        levels,
    )
    assert make_levels(sizes, LengthRange(32, 512), LengthRange(16, 256), 0, seed=1)[1] != levels


def test_a_shared_prefix_is_common_to_every_prompt() -> None:
    _, levels = make_levels([4, 4], LengthRange(10, 20), LengthRange(1, 1), 6, seed=0)
    prefixes = {tuple(item.prompt.split()[:6]) for level in levels for item in level}
    assert len(prefixes) == 1


def test_llama_cpp_and_llmpool_streams_count_the_same_tokens() -> None:
    """llmpool sends usage in its own chunk when asked; llama.cpp ends with an empty-text chunk
    that carries usage. A token arrives with text either way, and usage wins over counting."""
    llmpool_stream = [
        {"choices": [{"text": " a", "finish_reason": None}]},
        {"choices": [{"text": " b", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
    ]
    llama_cpp_stream = [
        {"choices": [{"text": " a", "finish_reason": None}]},
        {"choices": [{"text": " b", "finish_reason": None}]},
        {
            "choices": [{"text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2},
        },
    ]
    for stream in (llmpool_stream, llama_cpp_stream):
        result = RequestResult(ok=False)
        arrivals = [read_chunk(chunk, result) for chunk in stream]
        assert arrivals.count(True) == 2
        assert (result.output_tokens, result.prompt_tokens, result.counted_by) == (2, 7, "usage")


def test_without_usage_tokens_are_counted_per_text_chunk() -> None:
    result = RequestResult(ok=False)
    for text in (" a", "", " b", " c"):
        read_chunk({"choices": [{"text": text}]}, result)
    assert (result.output_tokens, result.counted_by) == (3, "chunks")


def test_a_level_says_how_its_tokens_were_counted() -> None:
    by_usage = RequestResult(ok=True, ttft=0.1, e2e=1.0, output_tokens=10, counted_by="usage")
    by_chunks = RequestResult(ok=True, ttft=0.1, e2e=1.0, output_tokens=10, counted_by="chunks")
    failed = RequestResult(ok=False, error="HTTP 500")
    level = summarize(4, [by_usage, by_chunks, failed], duration=2.0)
    assert (level.completed, level.failed, level.errors) == (2, 1, {"HTTP 500": 1})
    assert level.output_throughput == 10.0
    assert level.output_tokens_counted_by == "mixed"
    assert math.isnan(level.prompt_tokens_mean)
    assert summarize(4, [by_usage], 1.0).output_tokens_counted_by == "usage"


def level(concurrency: int, tok_s: float, itl_p50: float, ttft_p50: float) -> LevelSummary:
    return LevelSummary(
        concurrency=concurrency,
        completed=8,
        failed=0,
        duration_s=1.0,
        request_throughput=8.0,
        output_throughput=tok_s,
        output_throughput_ratio=math.nan,
        ttft_ms={"mean": ttft_p50, "p50": ttft_p50, "p95": ttft_p50, "p99": ttft_p50},
        tpot_ms={"mean": 1.0, "p50": 1.0, "p95": 1.0, "p99": 1.0},
        itl_ms={"mean": itl_p50, "p50": itl_p50, "p95": itl_p50, "p99": itl_p50},
        e2e_ms={"mean": 1.0, "p50": 1.0, "p95": 1.0, "p99": 1.0},
        errors={},
    )


def test_the_report_has_each_target_and_ratios_ours_over_each_peer() -> None:
    args = parse_args(
        ["--concurrency", "1,16", "--against", "llama.cpp=http://h:2", "--against", "http://h:3"]
        + ["--note", "shared machine"]
    )
    targets = [args.url, *args.against]
    levels = [
        [level(1, 30.0, 20.0, 100.0), level(16, 240.0, 40.0, 400.0)],
        [level(1, 60.0, 10.0, 50.0), level(16, 120.0, 80.0, 800.0)],
        [level(1, 30.0, 20.0, 100.0), level(16, 0.0, math.nan, math.nan)],
    ]
    report = build_report(args, targets, ["ours-model", "peer-model", "p3"], levels, host={})
    assert (report["name"], report["model"]) == ("llmpool", "ours-model")
    assert [level["output_throughput_ratio"] for level in report["levels"]] == [1.0, 8.0]
    assert [peer["name"] for peer in report["against"]] == ["llama.cpp", "h:3"]
    assert report["against"][0]["levels"][1]["output_throughput_ratio"] == 2.0
    assert report["ratios"]["llama.cpp"] == [
        {"concurrency": 1, "output_throughput_ratio": 0.5, "itl_p50_ratio": 2.0, "ttft_p50_ratio": 2.0},
        {"concurrency": 16, "output_throughput_ratio": 2.0, "itl_p50_ratio": 0.5, "ttft_p50_ratio": 0.5},
    ]  # fmt: skip
    failed_peer = report["ratios"]["h:3"][1]
    assert all(math.isnan(failed_peer[key]) for key in failed_peer if key != "concurrency")
    assert report["workload"]["input_words"] == "128"
    assert report["workload"]["requests_per_level"] == [64, 64]

    markdown = report_markdown(report)
    assert "\nshared machine\n" in markdown
    assert "### llmpool vs llama.cpp (ratio: llmpool / llama.cpp)" in markdown
    assert "| 16 | 240.0 / 120.0 (2.00x) | 40.0 / 80.0 (0.50x) | 400 / 800 (0.50x) |" in markdown
    assert markdown.count("| concurrency | ok / failed |") == 3


def test_without_peers_the_report_is_one_table() -> None:
    args = parse_args(["--concurrency", "1"])
    report = build_report(args, [args.url], ["m"], [[level(1, 30.0, 20.0, 100.0)]], host={})
    assert report["against"] == [] and report["ratios"] == {}
    markdown = report_markdown(report)
    assert markdown.count("| concurrency |") == 1 and "###" not in markdown


def test_ratios_need_the_same_level() -> None:
    ours, peer = vars(level(1, 1.0, 1.0, 1.0)), vars(level(4, 1.0, 1.0, 1.0))
    with pytest.raises(ValueError):
        level_ratios(ours, peer)
    with pytest.raises(ValueError):
        comparison_table("a", [ours], "b", [ours, peer])


def test_requests_per_level_are_one_number_or_one_per_level() -> None:
    assert plan_levels([64, 1, 16], [64, 8, 64], None) == [(1, 8), (16, 64), (64, 64)]
    assert plan_levels([1, 4], [6], None) == [(1, 6), (4, 6)]
    assert plan_levels([1, 4], [6], rounds=2) == [(1, 2), (4, 8)]
    for concurrency, num_prompts in (([1, 4], [1, 2, 3]), ([0, 4], [1]), ([1], [0])):
        with pytest.raises(ValueError):
            plan_levels(concurrency, num_prompts, None)
    args = parse_args(["--concurrency", "64,1,16", "--num-prompts", "64,8,32"])
    assert args.levels == [(1, 8), (16, 32), (64, 64)]
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "1,16", "--num-prompts", "8,64,64"])
