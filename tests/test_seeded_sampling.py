"""A seeded request's tokens are a function of (seed, prompt, parameters) only: the same through
a prefix-cache miss, a hit, a preemption's recompute and any batch neighbour (tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpool.engine import LLM, SamplingParams
from llmpool.engine.request import Request
from llmpool.engine.sampler import Sampler
from llmpool.engine.sampling_params import SEED_RANGE
from llmpool.engine.seeding import position_seed, race

# float32: the paths below run a prompt's rows through GEMMs of different sizes, which in
# bfloat16 round differently (docs/architecture.md, Sampler); the seed fixes the draws, not that.
TINY = {"dtype": "float32", "max_model_len": 128, "block_size": 16}
NEW_TOKENS = 24
VOCAB = 49152


@pytest.fixture(scope="module")
def fresh(tiny_folder: Path) -> LLM:
    """No prefix cache: every prompt computed from scratch, as on a fresh replica."""
    return LLM(model=str(tiny_folder), enable_prefix_caching=False, num_kv_blocks=64, **TINY)


@pytest.fixture(scope="module")
def cached(tiny_folder: Path) -> LLM:
    return LLM(model=str(tiny_folder), num_kv_blocks=64, **TINY)


@pytest.fixture(scope="module")
def tight(tiny_folder: Path) -> LLM:
    """Eight blocks (128 tokens) for batches that need ~16: requests are preempted."""
    return LLM(model=str(tiny_folder), num_kv_blocks=8, **TINY)


def tokens(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], **kw
) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, **kw)]


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(SEED_RANGE[0], SEED_RANGE[1]),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=20, max_size=40),
    temperature=st.sampled_from([0.8, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.9]),
)
def test_a_seeded_request_samples_the_same_tokens_whatever_the_engine_did(
    fresh: LLM,
    cached: LLM,
    tight: LLM,
    seed: int,
    prompt: list[int],
    temperature: float,
    top_p: float,
) -> None:
    params = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=NEW_TOKENS, ignore_eos=True, seed=seed
    )
    (expected,) = tokens(fresh, [prompt], [params])
    assert len(expected) == NEW_TOKENS

    # Miss then hit: the second run finds the prompt's full blocks cached.
    assert tokens(cached, [prompt], [params]) == [expected]
    hits = cached.stats().prefix_cache_hits
    assert tokens(cached, [prompt], [params]) == [expected]
    assert cached.stats().prefix_cache_hits - hits >= 16

    # Batch neighbours: an unseeded sampled one, a greedy one and another seed.
    neighbours = [
        SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS + 5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=seed ^ 1),
    ]
    others = [prompt[::-1], prompt[:7], [1, 2, 3, *prompt]]
    assert tokens(fresh, [*others, prompt], [*neighbours, params])[-1] == expected

    # Preemption: the seeded request runs at a worse priority class until requests of a better
    # one need its blocks; it is recomputed from its prompt and the tokens it had.
    assert preempted_run(tight, prompt, params, others) == expected


def preempted_run(
    llm: LLM, prompt: list[int], params: SamplingParams, others: list[list[int]]
) -> list[int]:
    engine = llm.engine
    engine.add_request("seeded", prompt, params, priority=1)
    seeded = engine.scheduler.requests["seeded"]
    got: list[int] = []
    while len(got) < 4:
        got += [t for d in engine.step() if d.request_id == "seeded" for t in d.new_token_ids]
    hog = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    for index, other in enumerate(others):
        engine.add_request(f"hog-{index}", (other * 3)[:60], hog, priority=0)
    while engine.has_unfinished_requests():
        got += [t for d in engine.step() if d.request_id == "seeded" for t in d.new_token_ids]
    assert seeded.num_preemptions > 0
    return got


def test_a_row_sampled_again_at_the_same_position_draws_the_same_token() -> None:
    """The draw is keyed by position, not by how many draws came before: a batch sampled row by
    row after a failure, or any replay, gives the seeded row the token it would have had."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    request = Request("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=11), frozenset())
    sampler = Sampler()
    first = sampler(logits, [request]).token_ids
    assert sampler(logits, [request]).token_ids == first
    drawn = set()
    for _ in range(8):
        request.append_output_token(0)
        drawn.add(sampler(logits, [request]).token_ids[0][0])
    assert len(drawn) > 1  # the next positions draw other uniforms


def test_position_seeds_differ_per_seed_and_position() -> None:
    """Consecutive seeds (choice i of n uses seed + i) and positions give other draws; a seed
    is taken modulo 2**64, as torch's manual_seed takes it."""
    seeds = {position_seed(s, p) for s in (7, 8, -7, 2**64 - 7) for p in range(4)}
    assert len(seeds) == 12
    assert position_seed(-7, 3) == position_seed(2**64 - 7, 3)


def test_the_race_follows_the_probabilities() -> None:
    """Over many positions, each token wins about as often as its probability says."""
    probs = torch.tensor([[0.5, 0.3, 0.0, 0.2]]).repeat(4000, 1)
    tokens = race(probs, [5] * 4000, list(range(4000)))
    share = torch.bincount(tokens, minlength=4).float() / 4000
    assert float(share[2]) == 0.0
    assert torch.allclose(share, probs[0], atol=0.03)
