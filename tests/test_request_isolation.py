"""One request cannot take the engine down: admission refuses what cannot run, a fault in one
request's own work fails that request alone, and an interrupted ``generate`` leaves nothing behind.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmpool.engine import LLM, SamplingParams
from llmpool.engine.admission import InvalidRequestError, PromptTooLongError
from llmpool.engine.config import EngineConfig
from llmpool.engine.sampler import Sampler

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, num_kv_blocks=64, priority_class="batch", dtype="float32")


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    """The prompt's greedy continuation when it runs alone."""
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"


@pytest.mark.parametrize(
    ("params", "priority", "param"),
    [
        (SamplingParams(stop_token_ids=[999_999], min_tokens=1), None, "stop_token_ids"),
        (SamplingParams(logit_bias={10**9: 5.0}), None, "logit_bias"),
        # The engine's class is batch and --max-request-priority defaults to it.
        (SamplingParams(), 0, "priority"),
        (SamplingParams(), 10**30, "priority"),
    ],
)
def test_admission_refuses_what_the_model_cannot_run(
    llm: LLM, params: SamplingParams, priority: int | None, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request("bad", [1, 2, 3], params, priority=priority)
    assert refused.value.param == param
    assert "bad" not in llm.engine.scheduler.requests
    assert_idle(llm)


def test_prompt_too_long_names_the_prompt(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError) as refused:
        llm.engine.add_request("long", [1] * 256, SamplingParams())
    assert refused.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seed": 2**64}, "seed must be a 64-bit integer"),
        ({"seed": -(2**63) - 1}, "seed must be a 64-bit integer"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": float("inf")}, "top_p must be a finite number"),
        ({"logit_bias": {5: 101.0}}, "logit_bias values must be between -100 and 100"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_request_priority_bound_follows_the_engine_flag() -> None:
    assert EngineConfig(priority_class="batch").request_priority_floor == 1
    assert (
        EngineConfig(
            priority_class="batch", max_request_priority="interactive"
        ).request_priority_floor
        == 0
    )
    assert EngineConfig().request_priority_floor == 0
    with pytest.raises(ValueError, match="max_request_priority"):
        EngineConfig(max_request_priority="urgent")


def test_top_k_beyond_the_vocabulary_means_no_top_k(llm: LLM) -> None:
    huge = SamplingParams(temperature=1.0, top_k=10**23, seed=7, max_tokens=6, ignore_eos=True)
    off = SamplingParams(temperature=1.0, top_k=-1, seed=7, max_tokens=6, ignore_eos=True)
    assert llm.generate(PROMPT, huge)[0].outputs[0].token_ids == (
        llm.generate(PROMPT, off)[0].outputs[0].token_ids
    )
    assert_idle(llm)


def test_logit_bias_matches_biased_hf_logits(llm: LLM, builtin_folder) -> None:
    """OpenAI semantics: the bias is added to the logits; -100 bans a token, +100 forces one."""
    model = AutoModelForCausalLM.from_pretrained(builtin_folder, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    first = int(logits.argmax())
    second = int(logits.topk(2).indices[1])
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100.0})
    assert llm.generate(PROMPT, banned)[0].outputs[0].token_ids == [second]
    forced_token = int(logits.argmin())
    forced = SamplingParams(temperature=0, max_tokens=1, logit_bias={forced_token: 100.0})
    expected = int(
        (
            logits + torch.nn.functional.one_hot(torch.tensor(forced_token), logits.numel()) * 100
        ).argmax()
    )
    assert llm.generate(PROMPT, forced)[0].outputs[0].token_ids == [expected]


def test_a_fault_while_sampling_one_request_fails_it_alone(llm: LLM, reference: list[int]) -> None:
    """The bug of issue 12 (a stop token id beyond the vocabulary, with min_tokens) planted past
    admission: the sampler's batch raises, the row-by-row retry isolates the culprit."""
    engine = llm.engine
    engine.add_request("good", llm.tokenizer.encode(PROMPT), GREEDY)
    engine.add_request("bad", llm.tokenizer.encode("Hello there"), SamplingParams(min_tokens=2))
    params = engine.scheduler.requests["bad"].sampling_params
    # Where the sampler reads it: the set built once from stop_token_ids.
    params.stop_token_set = params.stop_token_set | {999_999}
    deltas = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    assert [d.finish_reason for d in deltas["bad"]] == ["error"]
    assert "IndexError" in (deltas["bad"][0].error or "")
    assert [t for d in deltas["good"] for t in d.new_token_ids] == reference
    assert_idle(llm)


def test_a_fault_while_preparing_one_request_fails_it_alone(
    llm: LLM, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = llm.engine.runner
    prepare = runner.prepare_inputs

    def prepare_refusing_bad(scheduled):
        if any(r.request_id == "bad" for r in scheduled.requests):
            raise RuntimeError("injected fault in one request's inputs")
        return prepare(scheduled)

    monkeypatch.setattr(runner, "prepare_inputs", prepare_refusing_bad)
    engine = llm.engine
    engine.add_request("good", llm.tokenizer.encode(PROMPT), GREEDY)
    engine.add_request("bad", llm.tokenizer.encode("Hello there"), GREEDY)
    deltas = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    assert [d.finish_reason for d in deltas["bad"]] == ["error"]
    assert [t for d in deltas["good"] for t in d.new_token_ids] == reference
    assert_idle(llm)


def test_a_fault_of_the_model_step_is_not_swallowed(
    llm: LLM, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.runner.model, "forward", broken_forward)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([PROMPT, "Once upon a time"], GREEDY)
    monkeypatch.undo()
    assert_idle(llm)
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == reference


def test_generate_interrupted_by_ctrl_c_frees_its_requests(
    llm: LLM, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    sample = Sampler.__call__

    def sample_then_interrupt(self, logits, requests, *args):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return sample(self, logits, requests, *args)

    monkeypatch.setattr(Sampler, "__call__", sample_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "Once upon a time"], GREEDY)
    monkeypatch.undo()
    assert_idle(llm)
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == reference
