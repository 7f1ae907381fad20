"""Prefix caching changes no output: greedy tokens with the cache on equal those with it off."""

from __future__ import annotations

import pytest

from llmpool.engine import LLM, SamplingParams

SYSTEM_TEXT = (
    "You are a careful assistant for a library. Answer questions about opening hours, loans and"
    " renewals politely and briefly, and say so when you do not know the answer. The library"
    " opens at nine and closes at six on weekdays."
)
BLOCK_SIZE = 16
PARAMS = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
# float32: with and without the cache a prompt's rows go through GEMMs of different sizes, which
# in bfloat16 take different kernels (rounded differently) and can flip a near-tie.
SMALL_POOL = {
    "dtype": "float32",
    "max_model_len": 256,
    "num_kv_blocks": 48,
    "block_size": BLOCK_SIZE,
}


@pytest.fixture(scope="module")
def llm_without_cache() -> LLM:
    return LLM(enable_prefix_caching=False, **SMALL_POOL)


@pytest.fixture(scope="module")
def llm_with_cache() -> LLM:
    return LLM(enable_prefix_caching=True, **SMALL_POOL)


@pytest.fixture(scope="module")
def shared_prefix_prompts(llm_with_cache: LLM) -> list[list[int]]:
    """Prompts behind one 41-token prefix (2 full blocks and 9 tokens of a third), and more."""
    tokenizer = llm_with_cache.tokenizer
    prefix = tokenizer.encode(SYSTEM_TEXT)[:41]
    assert len(prefix) % BLOCK_SIZE != 0
    suffixes = [" Answer:", " In short,", " The key idea is", " Translate it to French:"]
    prompts = [prefix + tokenizer.encode(suffix) for suffix in suffixes]
    return (
        prompts
        + [
            prompts[0],  # the same prompt twice in one batch
            prefix[:32],  # a prompt of exactly two full cached blocks: one must be recomputed
            prefix + prompts[1][41:] + tokenizer.encode(" and then"),  # extends another prompt
        ]
    )


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, PARAMS)]


def test_shared_prefixes_in_one_step_match_no_cache(
    llm_with_cache: LLM, llm_without_cache: LLM, shared_prefix_prompts: list[list[int]]
) -> None:
    expected = token_ids(llm_without_cache, shared_prefix_prompts)
    before = llm_with_cache.stats()
    assert token_ids(llm_with_cache, shared_prefix_prompts) == expected
    after = llm_with_cache.stats()
    # All prompts are admitted in the first step; later ones share the first one's blocks.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 5 * 2 * BLOCK_SIZE
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(
        map(len, shared_prefix_prompts)
    )
    assert after.num_free_blocks == after.num_total_blocks
    # A second round finds the freed blocks still cached, outputs included.
    assert token_ids(llm_with_cache, shared_prefix_prompts) == expected
    again = llm_with_cache.stats()
    assert (
        again.prefix_cache_hits - after.prefix_cache_hits
        > after.prefix_cache_hits - before.prefix_cache_hits
    )


def test_cache_off_counts_nothing(llm_without_cache: LLM) -> None:
    stats = llm_without_cache.stats()
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0


def test_preempted_requests_match_no_cache(
    llm_without_cache: LLM, shared_prefix_prompts: list[list[int]]
) -> None:
    """Eight blocks hold 128 tokens; even sharing the prefix the batch needs ~16 blocks."""
    expected = token_ids(llm_without_cache, shared_prefix_prompts)
    tight = LLM(enable_prefix_caching=True, dtype="float32", max_model_len=80, num_kv_blocks=8)
    assert token_ids(tight, shared_prefix_prompts) == expected
    assert tight.num_preemptions > 0
    stats = tight.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_hits > 0
