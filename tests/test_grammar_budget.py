"""Grammar cost is bounded per request: a row whose mask is late skips the step while the others
step on, a request over its budget (or refused by llguidance mid-generation) ends alone with
``grammar_budget_exceeded``, and logprobs under a grammar stay finite. The tiny model throughout:
what is checked is the engine's bookkeeping, against the same engine's undisturbed runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from llmpool.engine import SamplingParams, StructuredOutputsParams
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.request import Request
from llmpool.engine.sampler import LOGPROB_FLOOR

# Ambiguous (``e e`` and ``e e e`` split any run many ways): its Earley sets grow with the output,
# and its masks with them, from milliseconds to tenths of a second within 40 tokens.
SLOW_GRAMMAR = 'start: e\ne: e e | e e e | "(" e ")" | e " " e | /[a-z ]/'
# As ambiguous over 16 one-letter rules: llguidance's item limit refuses its very first mask.
REFUSED_GRAMMAR = "start: s\ns: s s | s s s | c\nc: " + " | ".join(
    f'"{c}"' for c in "abcdefghijklmnop"
)
PROMPT = "The capital of France is"
MAX_STEPS = 1000  # far more than any test's requests take: a run that never ends fails instead


@pytest.fixture(scope="module")
def core(tiny_folder: Path) -> Iterator[EngineCore]:
    yield EngineCore(
        EngineConfig(
            model=str(tiny_folder), dtype="float32", max_model_len=256, num_kv_blocks=64,
            grammar_step_budget_ms=0.0,
        )
    )  # fmt: skip


@pytest.fixture(autouse=True)
def nothing_left(core: EngineCore) -> Iterator[None]:
    """A test that fails mid-way leaves no request to the next (a held mask never resolves)."""
    yield
    core.abort_requests(list(core.scheduler.requests))


@pytest.fixture
def budget(core: EngineCore) -> Iterator[None]:
    """Restores the engine's grammar budget after a test changes it."""
    manager = core.structured_outputs
    saved = manager.budget
    yield
    manager.budget = saved


def greedy(tokens: int, grammar: str | None = None, **extra: object) -> SamplingParams:
    spec = None if grammar is None else StructuredOutputsParams(grammar=grammar)
    return SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=spec, **extra)  # type: ignore[arg-type]


def run(
    core: EngineCore, steps: list[list[RequestDelta]] | None = None
) -> dict[str, list[RequestDelta]]:
    """Step until idle; every request's deltas (and each step's, into ``steps``)."""
    deltas: dict[str, list[RequestDelta]] = {}
    for _ in range(MAX_STEPS):
        if not core.has_unfinished_requests():
            break
        step = core.step()
        if steps is not None:
            steps.append(step)
        for delta in step:
            deltas.setdefault(delta.request_id, []).append(delta)
    else:
        raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")
    return deltas


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def prompt_ids(core: EngineCore) -> list[int]:
    return core.tokenizer.encode(PROMPT, add_special_tokens=False)


@dataclasses.dataclass
class LateMask:
    """A grammar request ("late") and a plain one, both past their first token, with the late
    one's next mask held back until the test sets ``held``; and their undisturbed tokens."""

    late: Request
    held: Future[object]
    deltas: dict[str, list[RequestDelta]]
    undisturbed: list[int]
    plain_alone: list[int]
    free_blocks: int

    def finish(self, core: EngineCore) -> None:
        """Release the mask, run to the end, and check both requests' tokens and the blocks."""
        self.held.set_result(core.structured_outputs.masks([self.late.grammar])[0])
        for request_id, more in run(core).items():
            self.deltas.setdefault(request_id, []).extend(more)
        assert tokens(self.deltas["late"]) == self.undisturbed
        assert tokens(self.deltas["plain"]) == self.plain_alone
        assert core.kv_cache_manager.num_free_blocks == self.free_blocks


def hold_a_mask(core: EngineCore) -> LateMask:
    grammar = "start: /[a-z ]+/"
    ids = prompt_ids(core)
    core.add_request("alone", ids, greedy(12, grammar))
    undisturbed = tokens(run(core)["alone"])
    core.add_request("plain-alone", ids, greedy(12))
    plain_alone = tokens(run(core)["plain-alone"])
    manager = core.structured_outputs
    patient = dataclasses.replace(manager.budget, step_seconds=60.0)
    free = core.kv_cache_manager.num_free_blocks
    core.add_request("late", ids, greedy(12, grammar))
    core.add_request("plain", ids, greedy(12))
    manager.budget = patient
    deltas = {d.request_id: [d] for d in core.step()}  # prefill: both sample their first token
    manager.budget = dataclasses.replace(patient, step_seconds=0.0)
    late = core.scheduler.requests["late"]
    held = Future[object]()  # the mask is not ready until the test says so
    late.grammar.next_mask = held  # type: ignore[union-attr,assignment]
    return LateMask(late, held, deltas, undisturbed, plain_alone, free)


def step_beside(core: EngineCore, case: LateMask) -> None:
    """One step in which the late row samples nothing and the plain row one token."""
    step = {d.request_id: d for d in core.step()}
    assert "late" not in step and len(step["plain"].new_token_ids) == 1
    case.deltas["plain"].append(step["plain"])
    assert case.late.num_computed_tokens == case.late.num_tokens - 1  # its last token runs again
    assert case.late.num_output_tokens == 1


def test_a_late_mask_defers_its_row_alone_and_changes_no_token(
    core: EngineCore, budget: None
) -> None:
    """A row whose mask is not ready samples nothing and keeps its blocks and position; the plain
    row beside it gets a token every step; once the mask is in, the row goes on to the same
    tokens as undisturbed."""
    case = hold_a_mask(core)
    # Counted from here: the undisturbed runs before, at a step budget of 0, may defer too.
    deferred_before = core.stats().grammar_rows_deferred
    blocks = list(core.kv_cache_manager.block_tables["late"])
    for _ in range(3):
        step_beside(core, case)
        assert core.kv_cache_manager.block_tables["late"] == blocks
    assert core.stats().grammar_rows_deferred - deferred_before == 3
    case.finish(core)


def test_a_deferred_row_is_preempted_and_resumes_the_same(core: EngineCore, budget: None) -> None:
    """Preempted while it waits for its mask, the row gives its blocks back, is recomputed when
    admitted again, waits again, and ends with its undisturbed tokens."""
    case = hold_a_mask(core)
    step_beside(core, case)
    scheduler = core.scheduler
    holding = core.kv_cache_manager.num_free_blocks
    scheduler.running.remove(case.late)
    scheduler._preempt(case.late)  # as _make_room does when the pool runs short
    assert core.kv_cache_manager.num_free_blocks > holding
    assert case.late.num_computed_tokens == 0
    for _ in range(2):
        step_beside(core, case)  # admitted again, recomputed, deferred
    assert case.late.num_preemptions == 1
    case.finish(core)


def test_a_pathological_grammar_beside_a_plain_request(core: EngineCore) -> None:
    """The plain request gets a token in every step until it ends, with its solo tokens; the
    grammar request is deferred, then completes or ends with grammar_budget_exceeded."""
    ids = prompt_ids(core)
    core.add_request("solo", ids, greedy(24))
    solo = tokens(run(core)["solo"])
    free = core.kv_cache_manager.num_free_blocks
    deferred_before = core.stats().grammar_rows_deferred
    core.add_request("slow", ids, greedy(64, SLOW_GRAMMAR))
    core.add_request("plain", ids, greedy(24))
    steps: list[list[RequestDelta]] = []
    deltas = run(core, steps)
    plain_steps = [any(d.request_id == "plain" for d in step) for step in steps]
    assert plain_steps[: len(solo)] == [True] * len(solo)  # never deferred, never waited out
    assert tokens(deltas["plain"]) == solo
    assert core.stats().grammar_rows_deferred > deferred_before
    last = deltas["slow"][-1]
    assert last.finished
    assert last.finish_reason in ("stop", "length") or last.error_code == "grammar_budget_exceeded"
    assert core.kv_cache_manager.num_free_blocks == free


def test_a_request_over_its_budget_ends_alone(core: EngineCore, budget: None) -> None:
    manager = core.structured_outputs
    manager.budget = dataclasses.replace(manager.budget, request_seconds=1e-9)
    ids = prompt_ids(core)
    free = core.kv_cache_manager.num_free_blocks
    ended_before = core.stats().grammar_budget_exceeded
    core.add_request("over", ids, greedy(8, "start: /[a-z ]+/"))
    core.add_request("plain", ids, greedy(8))
    deltas = run(core)
    (over,) = deltas["over"]
    assert over.finish_reason == "error" and over.error_code == "grammar_budget_exceeded"
    assert "mask budget" in (over.error or "")
    assert len(tokens(deltas["plain"])) == 8
    assert core.stats().grammar_budget_exceeded == ended_before + 1
    assert core.kv_cache_manager.num_free_blocks == free


def test_a_grammar_refused_mid_generation_ends_alone(core: EngineCore) -> None:
    ids = prompt_ids(core)
    free = core.kv_cache_manager.num_free_blocks
    core.add_request("refused", ids, greedy(8, REFUSED_GRAMMAR))
    (refused,) = run(core)["refused"]
    assert refused.finish_reason == "error" and refused.error_code == "grammar_budget_exceeded"
    assert "refused mid-generation" in (refused.error or "")
    assert core.kv_cache_manager.num_free_blocks == free


def test_logprobs_under_a_grammar_are_floored_not_infinite(core: EngineCore) -> None:
    core.add_request("choice", prompt_ids(core), greedy(4, 'start: "Paris" | "Rome"', logprobs=5))
    entries = [e for d in run(core)["choice"] for e in d.new_logprobs]
    values = [v for entry in entries for v in entry.values()]
    assert entries and all(math.isfinite(v) and v >= LOGPROB_FLOOR for v in values)
    assert LOGPROB_FLOOR in values  # the masked-out tokens among the top 5
