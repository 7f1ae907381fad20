"""Prompt-lookup speculative decoding: proposer, verification rule, scheduler, and the engine's
greedy output, which drafts must leave identical."""

from __future__ import annotations

import random
from dataclasses import MISSING, fields, replace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from llmpool.engine import LLM
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineStats
from llmpool.engine.kernels import sampling
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.outputs import RequestOutput
from llmpool.engine.request import Request
from llmpool.engine.sampler import Sampler
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.scheduler import Scheduler
from llmpool.engine.server.cli import build_parser, engine_config
from llmpool.engine.server.metrics import EngineMetrics
from llmpool.engine.spec_decode.config import SpeculativeConfig
from llmpool.engine.spec_decode.ngram import NgramProposer
from llmpool.engine.structured_outputs import StructuredOutputsParams
from tests.conftest import FLOAT32_ENGINE


def proposer(k: int = 4, lookup_min: int = 1, lookup_max: int = 3) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(
            num_speculative_tokens=k, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max
        )
    )


# --- proposer --------------------------------------------------------------------------------


def test_proposes_what_followed_the_longest_most_recent_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 9, 9, 7, 1, 2, 3, 4, 6, 1, 2]
    # "1 2" occurred at 1-2 (then 9 9 7 1) and at 6-7 (then 3 4 6 1): the most recent wins.
    assert proposer().propose(tokens, 8) == [3, 4, 6, 1]
    # With "4 6 1 2" somewhere earlier, the longer match wins over the more recent one.
    longer = [4, 6, 1, 2, 8, 8, 0, *tokens]
    assert proposer(lookup_max=4).propose(longer, 8) == [8, 8, 0, 5]


def test_no_match_and_lookup_bounds() -> None:
    assert proposer().propose([1, 2, 3, 4], 4) == []
    # Only the last token (n = 1) occurred before: allowed with min 1, not with min 2.
    tokens = [7, 8, 9, 3, 7]
    assert proposer(lookup_min=1).propose(tokens, 4) == [8, 9, 3, 7]
    assert proposer(lookup_min=2).propose(tokens, 4) == []
    # A match longer than lookup_max counts as lookup_max: the most recent of those wins.
    tokens = [1, 2, 3, 10, 9, 2, 3, 11, 1, 2, 3]
    assert proposer(lookup_max=2).propose(tokens, 1) == [11]
    assert proposer(lookup_max=3).propose(tokens, 1) == [10]


def test_drafts_are_bounded() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert proposer(k=2).propose(tokens, 8) == [3, 4]
    assert proposer(k=4).propose(tokens, 3) == [3, 4, 5]
    assert proposer(k=4).propose(tokens, 0) == []
    # A match near the end proposes only the tokens that exist after it.
    assert proposer(k=4).propose([3, 5, 3], 4) == [5, 3]
    assert proposer().propose([3], 4) == []


# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "eagle"}', "method must be"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 99}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"prompt_lookup_min": "1"}', "prompt_lookup_min"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size"),
        ('{"num_speculative_token": 4}', "unknown keys num_speculative_token"),
        ("{ngram}", "not valid JSON"),
        ("[4]", "must be a JSON object"),
    ],
)
def test_bad_speculative_config_is_refused_at_start(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)
    args = build_parser().parse_args(["--speculative-config", value])
    with pytest.raises(ValueError, match=message):
        engine_config(args)


def test_speculative_config_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_config(build_parser().parse_args([])).speculative is None
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}'
    config = engine_config(build_parser().parse_args(["--speculative-config", flag])).speculative
    assert config == SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=8)
    monkeypatch.setenv("LLMPOOL_SPECULATIVE_CONFIG", '{"prompt_lookup_max": 2}')
    config = engine_config(build_parser().parse_args([])).speculative
    assert config == SpeculativeConfig(prompt_lookup_max=2)
    assert config is not None and config.disable_by_batch_size == 16
    unbounded = SpeculativeConfig.parse('{"method": "ngram", "disable_by_batch_size": null}')
    assert unbounded.disable_by_batch_size is None


# --- verification ----------------------------------------------------------------------------


def sampling_request(request_id: str, params: SamplingParams) -> Request:
    return Request(request_id, [1, 2, 3], params, frozenset())


def test_greedy_verification_accepts_up_to_the_first_mismatch() -> None:
    vocab = 6
    # Request a: argmaxes 2, 4, 1, 5 for drafts [2, 4, 0]: two accepted, then the target's 1.
    # Request b: drafts [3] accepted, then the bonus 0. Request c: no drafts, argmax 5.
    argmaxes = [2, 4, 1, 5, 3, 0, 5]
    logits = torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()
    greedy = SamplingParams(temperature=0)
    requests = [sampling_request(name, greedy) for name in "abc"]
    out = Sampler()(logits, requests, drafts=[[2, 4, 0], [3], []])
    assert out.token_ids == [[2, 4, 1], [3, 0], [5]]


@pytest.mark.parametrize("kernel", [True, False], ids=["sample_rows", "torch"])
def test_sampled_verification_follows_the_target_distribution(
    monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    """Accept with p(x), else sample p without x: each token then follows p exactly. Rules that
    accept more (always) or resample from p with x (twice p(x)-ish) miss by far more than the
    tolerance, which is ~6 standard deviations of 20000 draws. By ``sampling.c`` and, as without
    a compiler, by torch's ops."""
    if not kernel:
        monkeypatch.setattr(sampling.KERNEL, "library", lambda: None)
    torch.manual_seed(0)
    first = torch.tensor([0.1, 0.5, 0.15, 0.25])
    second = torch.tensor([0.6, 0.1, 0.2, 0.1])
    draws = 20000
    params = SamplingParams(temperature=1.0)
    requests = [sampling_request(str(i), params) for i in range(draws)]
    rows = torch.stack([first.log(), second.log()]).repeat(draws, 1)
    out = Sampler()(rows, requests, drafts=[[2]] * draws)
    first_tokens = torch.tensor([tokens[0] for tokens in out.token_ids])
    frequencies = torch.bincount(first_tokens, minlength=4).float() / draws
    assert torch.allclose(frequencies, first, atol=0.02), frequencies
    bonus = torch.tensor([tokens[1] for tokens in out.token_ids if len(tokens) == 2])
    # The draft (2) was accepted in ~15% of draws; those then sample the bonus from `second`.
    assert abs(len(bonus) / draws - 0.15) < 0.02
    frequencies = torch.bincount(bonus, minlength=4).float() / len(bonus)
    assert torch.allclose(frequencies, second, atol=0.04), frequencies


# --- scheduler -------------------------------------------------------------------------------


def test_scheduler_with_drafts_returns_every_block() -> None:
    """Fake verification accepts a random number of drafts; budgets and blocks run short, so
    drafts are dropped and requests preempted; aborts happen mid-run. No block is leaked,
    computed tokens never pass the request's tokens, and the budget holds."""
    rng = random.Random(0)
    block_size, num_blocks, budget = 4, 24, 12
    manager = KVCacheManager(num_blocks, block_size)
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    scheduler = Scheduler(manager, 4, budget, num_blocks * block_size, config)
    for i in range(8):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(3, 30), ignore_eos=True)
        prompt = [rng.randint(0, 5) for _ in range(rng.randint(3, 20))]
        scheduler.add_request(Request(str(i), prompt, params, frozenset()))
    drafted = 0
    for step in range(500):
        if not scheduler.has_unfinished_requests():
            break
        if step == 7:
            scheduler.abort_request("3")
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= budget
        sampled = {}
        for request, count in zip(output.requests, output.num_scheduled_tokens, strict=True):
            drafts = request.spec_token_ids
            assert request.num_computed_tokens + count == request.num_tokens + len(drafts) or (
                not drafts and request.num_computed_tokens + count < request.num_tokens
            )
            drafted += len(drafts)
            max_tokens = request.sampling_params.max_tokens
            assert len(drafts) <= max_tokens - request.num_output_tokens - 1 or not drafts
            if request.num_computed_tokens + count >= request.num_tokens:
                accepted = rng.randint(0, len(drafts))
                sampled[request.request_id] = [*drafts[:accepted], rng.randint(0, 5)]
        scheduler.update_from_output(output, sampled)
        for request in scheduler.running:
            assert request.num_computed_tokens < request.num_tokens
    assert not scheduler.has_unfinished_requests()
    assert drafted > 0 and scheduler.spec_decoding.num_draft_tokens == drafted
    assert manager.num_free_blocks == num_blocks
    assert not manager.block_tables


def test_no_drafts_at_or_above_the_batch_size_limit() -> None:
    for num_requests, speculates in ((1, True), (2, False)):
        config = SpeculativeConfig(disable_by_batch_size=2)
        scheduler = Scheduler(KVCacheManager(64, 4), 8, 64, 256, config)
        params = SamplingParams(temperature=0, max_tokens=20)
        for i in range(num_requests):
            scheduler.add_request(Request(str(i), [1, 2, 3, 1, 2, 3, 1, 2], params, frozenset()))
        prefill = scheduler.schedule()
        scheduler.update_from_output(prefill, {r.request_id: [3] for r in prefill.requests})
        scheduler.schedule()
        assert [r.spec_token_ids for r in scheduler.running] == (
            [[1, 2, 3]] if speculates else [[], []]
        )


# --- the engine, real model ------------------------------------------------------------------

_PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, trimmed the wick, wound the clock "
    "that turned the lens, and wrote the weather in the log: wind from the west, sea rising, "
    "two ships passing north before midnight."
)
_CODE = (
    "def total_price(items, tax):\n"
    "    x = 0\n"
    "    for item in items:\n"
    "        x = x + item.price * item.quantity\n"
    "    x = x * (1 + tax)\n"
    "    return round(x, 2)\n"
)
SPEC_PROMPTS = [
    f"Repeat the following passage word for word.\n\nPassage: {_PASSAGE}\n\nRepeated: {_PASSAGE[:60]}",
    f"{_CODE}\n# The same function with the variable x renamed to subtotal:\n{_CODE[:30]}",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4,",
    "The capital of France is",
]
# Drafts at every batch size: the stop test runs 25 requests at once.
SPEC_CONFIG = {
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,
}


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    return LLM(**FLOAT32_ENGINE), LLM(**FLOAT32_ENGINE, speculative_config=SPEC_CONFIG)


def assert_same_outputs(expected: list[RequestOutput], actual: list[RequestOutput]) -> None:
    for want, got in zip(expected, actual, strict=True):
        want_out, got_out = want.outputs[0], got.outputs[0]
        assert got_out.token_ids == want_out.token_ids
        assert got_out.text == want_out.text
        assert (got_out.finish_reason, got_out.stop_reason) == (
            want_out.finish_reason,
            want_out.stop_reason,
        )


def assert_no_blocks_held(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_greedy_output_is_unchanged_beside_requests_that_do_not_speculate(
    engines: tuple[LLM, LLM],
) -> None:
    """Drafts are accepted (so the check can fail), and the greedy tokens are those of the engine
    without speculation; a logprobs request and a grammar request share the batches."""
    plain, speculating = engines
    greedy = SamplingParams(temperature=0, max_tokens=40)
    others = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(
            temperature=0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex="[a-z ]+"),
        ),
    ]
    prompts = [*SPEC_PROMPTS, SPEC_PROMPTS[0], SPEC_PROMPTS[3]]
    params = [greedy] * len(SPEC_PROMPTS) + others
    before = speculating.stats()
    expected = plain.generate(prompts, params)
    actual = speculating.generate(prompts, params)
    after = speculating.stats()
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    assert_same_outputs(expected, actual)
    for want, got in zip(expected[-2:-1], actual[-2:-1], strict=True):
        for want_entry, got_entry in zip(
            want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True
        ):
            assert got_entry.keys() == want_entry.keys()
            assert got_entry == pytest.approx(want_entry, abs=1e-4)
    assert_no_blocks_held(speculating)


def test_stops_inside_accepted_runs_end_where_they_do_without_drafts(
    engines: tuple[LLM, LLM],
) -> None:
    """Stop strings taken from the middle of the outputs, and max_tokens of every length up to
    the output's, cut the runs of accepted drafts at the same token as one-at-a-time decoding."""
    plain, speculating = engines
    repetitive = SPEC_PROMPTS[:3]
    full = plain.generate(repetitive, SamplingParams(temperature=0, max_tokens=32))
    stops = [output.outputs[0].text[20:26] for output in full]
    stop_params = [SamplingParams(temperature=0, max_tokens=32, stop=[stop]) for stop in stops]
    prompts = repetitive * 2 + [repetitive[i % 3] for i in range(1, 20)]
    params = (
        stop_params
        + [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3)]
        + [SamplingParams(temperature=0, max_tokens=m) for m in range(4, 23)]
    )
    expected = plain.generate(prompts, params)
    assert any(out.outputs[0].stop_reason in stops for out in expected)
    actual = speculating.generate(prompts, params)
    assert_same_outputs(expected, actual)
    assert_no_blocks_held(speculating)


# Every count zero: what a stats update says of an engine that has done nothing yet.
IDLE_STATS = EngineStats(**{f.name: 0 for f in fields(EngineStats) if f.default is MISSING})


def test_acceptance_counters_on_metrics() -> None:
    metrics = EngineMetrics("smollm2")
    for drafts, draft_tokens, accepted in ((2, 8, 3), (5, 20, 11)):
        metrics.on_stats(
            replace(
                IDLE_STATS,
                spec_decode_num_drafts=drafts,
                spec_decode_num_draft_tokens=draft_tokens,
                spec_decode_num_accepted_tokens=accepted,
            )
        )
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    assert values["llmpool:spec_decode_num_drafts_total"] == 5
    assert values["llmpool:spec_decode_num_draft_tokens_total"] == 20
    assert values["llmpool:spec_decode_num_accepted_tokens_total"] == 11
