"""Structured outputs in the engine: the grammar mask never changes an allowed choice, every
answer matches its grammar, and the grammar state survives preemption, prefix caching and ``n``."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from llmpool.engine import LLM, SamplingParams, StructuredOutputsParams
from llmpool.engine.admission import InvalidRequestError
from llmpool.engine.structured_outputs import MAX_SPEC_BYTES, GrammarError

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# Few-shot prompts whose greedy continuation starts with a JSON line the schema accepts.
JSON_LINES = (
    'Three people as JSON lines.\n\n{"name": "Ann", "age": 40, "city": "Oslo"}\n'
    '{"name": "Tom", "age": 22, "city": "Rome"}\n{"name": "Eva", "age": 31, "city": "Paris"}\n'
)
PROMPTS = [
    JSON_LINES,
    "The capital of France is",
    "def fibonacci(n):",
    "Question: What are three benefits of regular exercise? Answer:",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=64)


def greedy(max_tokens: int, grammar: StructuredOutputsParams | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=grammar)


def expected_under_grammar(
    llm: LLM, grammar: StructuredOutputsParams, tokens: list[int]
) -> list[int]:
    """The unconstrained greedy tokens cut where the grammar completes.

    Every one of them must be allowed (the premise of the parity check, asserted), so masking
    leaves each step's argmax where it was and the constrained run must pick the same tokens.
    """
    matcher = llm.engine.structured_outputs.matcher(grammar).llguidance_matcher
    for count, token in enumerate(tokens, start=1):
        assert matcher.consume_token(token), f"premise: token {count} is not allowed"
        if matcher.is_stopped():
            return tokens[:count]
    return tokens


@pytest.mark.parametrize(
    "prompt, grammar",
    [
        (PROMPTS[0], StructuredOutputsParams(json=PERSON)),
        (PROMPTS[0], StructuredOutputsParams(json_object=True)),
        (
            PROMPTS[0],
            StructuredOutputsParams(regex=r'\{"name": "[A-Z][a-z]+", "age": [0-9]+[\s\S]*'),
        ),
        (PROMPTS[1], StructuredOutputsParams(regex=r"[\s\S]*")),
        (PROMPTS[2], StructuredOutputsParams(grammar="start: /[\\s\\S]*/")),
    ],
    ids=["json-schema", "json-object", "regex", "anything-regex", "anything-lark"],
)
def test_mask_keeps_greedy_choice(llm: LLM, prompt: str, grammar: StructuredOutputsParams) -> None:
    free = llm.generate([prompt], greedy(48))[0].outputs[0].token_ids
    expected = expected_under_grammar(llm, grammar, free)
    constrained = llm.generate([prompt], greedy(48, grammar))[0].outputs[0]
    assert constrained.token_ids == expected
    if len(expected) < len(free):
        assert constrained.finish_reason == "stop"


def test_mixed_batch_leaves_other_requests_alone(llm: LLM) -> None:
    """Rows without a grammar sample exactly as they do alone, beside rows with one."""
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(32))]
    params = [
        greedy(32, StructuredOutputsParams(json=PERSON)) if i % 2 else greedy(32) for i in range(4)
    ]
    mixed = llm.generate(PROMPTS, params)
    for index in (0, 2):
        assert mixed[index].outputs[0].token_ids == alone[index]
    for index in (1, 3):
        jsonschema.validate(json.loads(mixed[index].outputs[0].text), PERSON)


def test_sampled_choices_each_follow_the_grammar(llm: LLM) -> None:
    grammar = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(temperature=1.0, seed=1, n=6, max_tokens=64, structured_outputs=grammar)
    for output in llm.generate([PROMPTS[3]], params)[0].outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), PERSON)


@pytest.mark.parametrize(
    "grammar, check",
    [
        (
            StructuredOutputsParams(choice=["yes", "no", 'it "depends"']),
            lambda t: t in ("yes", "no", 'it "depends"'),
        ),
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
            lambda t: len(t) == 8 and t[3] == "-",
        ),
        (
            StructuredOutputsParams(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]+/'),
            lambda t: t[0] == "(" and t[-1] == ")",
        ),
    ],
    ids=["choice", "regex", "lark"],
)
def test_complete_grammar_ends_the_request(
    llm: LLM, grammar: StructuredOutputsParams, check
) -> None:
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=40, structured_outputs=grammar)
    for output in llm.generate([PROMPTS[3]], params)[0].outputs:
        assert output.finish_reason == "stop", output.text
        assert check(output.text), output.text


def test_grammar_survives_preemption_and_prefix_caching(llm: LLM) -> None:
    """Eight blocks of 16 tokens cannot hold four requests at once: some are preempted and
    recomputed, from cached prefix blocks, mid-grammar; their answers match the roomy engine's."""
    grammar = StructuredOutputsParams(json=PERSON)
    prompts = [JSON_LINES + "\n" * i for i in range(4)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40, grammar))]
    tight = LLM(dtype="float32", max_model_len=128, num_kv_blocks=8, enable_prefix_caching=True)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy(40, grammar))]
    assert tight.num_preemptions > 0
    assert got == expected
    stats = tight.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_stop_string_cuts_a_constrained_answer(llm: LLM) -> None:
    grammar = StructuredOutputsParams(json=PERSON)
    whole = llm.generate([JSON_LINES], greedy(48, grammar))[0].outputs[0].text
    params = SamplingParams(
        temperature=0, max_tokens=48, stop=['"age"'], structured_outputs=grammar
    )
    cut = llm.generate([JSON_LINES], params)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert whole.startswith(cut.text) and '"age"' not in cut.text


@pytest.mark.parametrize(
    "grammar, says",
    [
        (StructuredOutputsParams(json={"type": "no-such-type"}), "does not compile"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="(unclosed"), "does not compile"),
        (StructuredOutputsParams(grammar="start: missing_rule"), "does not compile"),
        (StructuredOutputsParams(choice=[]), "choice takes"),
        (StructuredOutputsParams(regex="a" * (MAX_SPEC_BYTES + 1)), "bytes; at most"),
    ],
)
def test_bad_grammar_is_refused_and_nothing_is_queued(
    llm: LLM, grammar: StructuredOutputsParams, says: str
) -> None:
    with pytest.raises(GrammarError, match=says):
        llm.engine.structured_outputs.compile(grammar)
    with pytest.raises(InvalidRequestError, match=says) as error:
        llm.engine.add_request("bad-grammar", [1, 2, 3], greedy(8, grammar))
    assert error.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_spec() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_grammars_are_cached_per_spec(llm: LLM) -> None:
    seen: list[bool] = []
    manager = llm.engine.structured_outputs
    manager.on_compile = lambda kind, seconds, hit: seen.append(hit)
    try:
        schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}}
        manager.compile(StructuredOutputsParams(json=schema))
        manager.compile(
            StructuredOutputsParams(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))
        )
    finally:
        manager.on_compile = None
    assert seen == [False, True]


def test_mask_rows(llm: LLM) -> None:
    """The batch mask agrees with llguidance's own per-matcher bitmask, bit for bit."""
    manager = llm.engine.structured_outputs
    matcher = manager.matcher(StructuredOutputsParams(choice=["Paris", "London"]))
    masks = manager.masks([None, matcher])
    assert masks[0].all()
    reference = llguidance.LLMatcher.compute_bitmask(matcher.llguidance_matcher)
    allowed = {token for token in range(masks.shape[1]) if reference[token // 8] >> (token % 8) & 1}
    assert set(masks[1].nonzero()[0].tolist()) == allowed
    assert 0 < len(allowed) < 100
