"""Sampling and stopping on the built-in model: every SamplingParams field does what vLLM's does."""

from __future__ import annotations

import pytest
import torch

from llmpool.engine import LLM, SamplingParams
from llmpool.engine.kernels import sampling
from llmpool.engine.request import Request
from llmpool.engine.sampler import Sampler

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32: bfloat16 logits tie often enough (8-bit mantissa) that min_p=1.0 would keep two
    # tokens, and a tie is not greedy's to break.
    return LLM(max_model_len=1024, num_kv_blocks=128, dtype="float32")


@pytest.fixture(scope="module")
def greedy(llm: LLM):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[
        0
    ].outputs[0]


def run(llm: LLM, **params) -> object:
    return llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0]


def test_filters_that_keep_one_token_are_greedy(llm: LLM, greedy) -> None:
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        out = run(llm, temperature=1.0, max_tokens=40, ignore_eos=True, seed=3, **params)
        assert out.token_ids == greedy.token_ids, params


def test_seed_gives_the_same_tokens_whatever_shares_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=1234)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True, seed=s) for s in (1, None)
    ]
    crowded = llm.generate(["Hello", PROMPT, "def f(x):"], [others[0], params, others[1]])
    assert crowded[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=99
    )
    assert llm.generate(PROMPT, different_seed)[0].outputs[0].token_ids != alone


def test_n_returns_distinct_samples_in_order(llm: LLM) -> None:
    result = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=5))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1


def test_stop_string_ends_text_before_it(llm: LLM, greedy) -> None:
    stop = greedy.text[len(greedy.text) // 2 : len(greedy.text) // 2 + 6]
    assert stop.strip()
    out = run(llm, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == greedy.text[: greedy.text.index(stop)]
    kept = run(llm, temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == greedy.text[: greedy.text.index(stop) + len(stop)]


def test_stop_token_id(llm: LLM, greedy) -> None:
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    out = run(llm, temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    held = run(llm, temperature=0, max_tokens=40, min_tokens=first + 3, stop_token_ids=[stop_id])
    assert len(held.token_ids) >= first + 3


def test_eos_min_tokens_max_tokens_and_ignore_eos(llm: LLM) -> None:
    chat = [{"role": "user", "content": "Reply with just the word yes."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    assert len(short.token_ids) < 64
    held = llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 5)
    )
    assert len(held[0].outputs[0].token_ids) >= len(short.token_ids) + 5
    full = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[
        0
    ]
    assert len(full.token_ids) == 30 and full.finish_reason == "length"


def test_logprobs_report_the_chosen_and_top_tokens(llm: LLM, greedy) -> None:
    out = run(llm, temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    assert len(out.logprobs) == 8
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry and len(entry) <= 4
        assert entry[token_id] == max(entry.values())  # greedy picks the most likely token
        assert all(value <= 0 for value in entry.values())


def test_penalties_change_greedy_output(llm: LLM, greedy) -> None:
    penalized = run(llm, temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.5)
    assert penalized.token_ids != greedy.token_ids
    assert len(set(penalized.token_ids)) >= len(set(greedy.token_ids))


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    for i in range(4):
        engine.add_request(
            f"abort-{i}",
            llm.tokenizer.encode(PROMPT * (i + 1)),
            SamplingParams(max_tokens=100, ignore_eos=True),
        )
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.num_total_blocks
    engine.abort_requests([f"abort-{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_total_blocks


def test_memory_waste_stays_under_one_block_per_sequence(llm: LLM) -> None:
    """After every step of a mixed-length batch, allocated slots exceed cached tokens by < block."""
    engine = llm.engine
    block_size = engine.kv_cache_manager.block_size
    lengths = [3, 17, 40, 95, 160, 250]
    for i, length in enumerate(lengths):
        engine.add_request(
            f"mem-{i}",
            [200 + (j % 500) for j in range(length)],
            SamplingParams(max_tokens=20, ignore_eos=True),
        )
    worst = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            allocated = len(engine.kv_cache_manager.block_tables[request.request_id]) * block_size
            waste = allocated - request.num_computed_tokens
            worst = max(worst, waste)
            assert 0 <= waste < block_size, (
                request.request_id,
                allocated,
                request.num_computed_tokens,
            )
    assert worst > 0  # the check saw partly filled tail blocks


def test_bad_parameters_are_refused_before_queueing(llm: LLM) -> None:
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 2},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="maximum context length is 1,024"):
        llm.generate([[5] * 1024], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_choices_share_their_params_lists_and_logit_bias_applies_per_row() -> None:
    """``for_choice`` copies share the sets and tensors built once; rows without a bias (or with
    another one) in the same batch are left alone."""
    biased = SamplingParams(n=3, seed=7, logit_bias={3: 100.0, 5: -100.0}, stop_token_ids=[9, 9])
    choices = [biased.for_choice(i) for i in range(biased.n)]
    assert [c.seed for c in choices] == [7, 8, 9] and all(c.n == 1 for c in choices)
    assert all(c.stop_token_set is biased.stop_token_set == {9} for c in choices)
    assert all(c.logit_bias_ids is biased.logit_bias_ids for c in choices)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(n=2, seed=2**64 - 1)
    other = SamplingParams(logit_bias={0: 100.0})
    rows = [choices[0], SamplingParams(temperature=0), other, choices[1]]
    requests = [Request(f"r{i}", [1], p, frozenset()) for i, p in enumerate(rows)]
    logits = torch.zeros(len(rows), 8)
    biased_logits = Sampler._apply_logit_bias(logits, [r.sampling_params for r in requests])
    expected = torch.zeros(len(rows), 8)
    expected[[0, 3], 3], expected[[0, 3], 5], expected[2, 0] = 100.0, -100.0, 100.0
    assert torch.equal(biased_logits, expected)
    assert Sampler()(logits, requests).token_ids == [[3], [0], [0], [3]]


def test_a_step_that_only_takes_argmaxes_samples_what_the_full_path_samples() -> None:
    """The argmax-only step (bfloat16 logits straight into greedy.c) against the same rows
    through the full path, which a row with logprobs, min_tokens or a penalty sends the batch
    down; and those rows still get what they asked for."""
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[:, 7] = logits.max() + 1  # every row's argmax, EOS below
    plain = [Request(f"r{i}", [1], SamplingParams(temperature=0), frozenset({7})) for i in range(6)]
    fast = Sampler()(logits, plain)
    assert fast.token_ids == [[7]] * 6 and fast.logprobs == [None] * 6
    for changed in (
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0, min_tokens=1),
        SamplingParams(temperature=0, repetition_penalty=2.0),
    ):
        rows = [*plain[:5], Request("x", [7], changed, frozenset({7}))]
        full = Sampler()(logits, rows)
        assert full.token_ids[:5] == fast.token_ids[:5]
        assert full.token_ids[5] == [7] if changed.logprobs else full.token_ids[5] != [7]
        assert (full.logprobs[5] is not None) == (changed.logprobs is not None)


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({}, [0, 1, 2, 3, 4]),
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.8}, [0, 1, 2]),  # 0.4 + 0.3 < 0.8 <= 0.4 + 0.3 + 0.15
        ({"top_p": 0.8, "top_k": 4}, [0, 1, 2]),
        ({"min_p": 0.3}, [0, 1, 2]),  # at least 0.3 x 0.4
    ],
)
@pytest.mark.parametrize("kernel", [True, False], ids=["sample_rows", "torch"])
def test_sampled_tokens_follow_the_kept_distribution(
    monkeypatch: pytest.MonkeyPatch, params: dict, kept: list[int], kernel: bool
) -> None:
    """20,000 rows drawn at temperature 1: each kept token as often as its renormalized
    probability (within ~6 standard deviations), the others never; by ``sampling.c`` and, as
    without a compiler, by torch's ops."""
    if not kernel:
        monkeypatch.setattr(sampling.KERNEL, "library", lambda: None)
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    draws = 20000
    requests = [
        Request(str(i), [1], SamplingParams(temperature=1.0, **params), frozenset())
        for i in range(draws)
    ]
    tokens = Sampler()(probs.log().repeat(draws, 1), requests).token_ids
    frequencies = torch.bincount(torch.tensor(tokens)[:, 0], minlength=6).float() / draws
    expected = torch.zeros(6)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert torch.allclose(frequencies, expected, atol=0.02), frequencies
    assert frequencies[[t for t in range(6) if t not in kept]].sum() == 0
