"""Sampler: turns one step's logits into next tokens, each request with its own parameters.

Work is batched over requests; the only per-request loop draws seeded rows' noise, a function of
the request's seed and the output position it samples (``seeding.py``), so that a request with
a seed samples the same tokens whatever else shares its batch, whatever its prefix cache or a
preemption did. Min-p, top-k and top-p are one probability threshold a row (``keep_thresholds``,
no sort of the vocabulary), and an unseeded row draws its token by inverse transform: one
uniform and a running sum, not noise over the vocabulary; on CPU all of it is one C call
(``sample_rows``), torch's ops elsewhere. A seeded row races its tokens with noise over the
vocabulary instead, which the logits' last bits do not move (``seeding.py`` says why). A step whose requests all
take the argmax of their logits as they come (greedy, nothing that changes the logits, no
logprobs, no drafts) skips all of that: one C kernel over the LM head's own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmpool.engine import seeding
from llmpool.engine.kernels.sampling import greedy_tokens, keep_thresholds, sample_rows
from llmpool.engine.request import Request
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.spec_decode import rejection

# The logprob reported for a token that could not be drawn (OpenAI reports -9999.0 too).
LOGPROB_FLOOR = -9999.0


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]  # per request, its new tokens: one, or with drafts up to k + 1
    # Per request: {token_id: logprob} of the chosen token and the top-k, or None when not asked.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        allowed: torch.Tensor | None = None,
        drafts: Sequence[list[int]] | None = None,
    ) -> SamplerOutput:
        """``logits`` (the LM head's dtype; the sampler works in float32) has one row per
        sampling request, or with ``drafts``, ``1 + len(drafts[i])`` rows for request ``i``
        (spec_decode/rejection.py); ``allowed`` (one row per request, bool) is False where a
        request's grammar forbids a token."""
        if allowed is None and not any(drafts or []) and all(map(_takes_the_argmax, requests)):
            tokens = greedy_tokens(logits).tolist()
            return SamplerOutput([[token] for token in tokens], [None] * len(tokens))
        return self.full(logits, requests, allowed, drafts)

    def full(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        allowed: torch.Tensor | None = None,
        drafts: Sequence[list[int]] | None = None,
    ) -> SamplerOutput:
        """``__call__`` by the whole path whatever the requests ask, in float32."""
        drafts = drafts if drafts is not None else [[] for _ in requests]
        logits = logits.float()
        counts = [len(draft) + 1 for draft in drafts]
        rows = [r for r, count in zip(requests, counts, strict=True) for _ in range(count)]
        if allowed is not None and len(rows) > len(requests):
            allowed = allowed.repeat_interleave(torch.tensor(counts), dim=0)
        logits = self._process(logits, rows, allowed)
        params = [r.sampling_params for r in rows]
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        draft_tokens = rejection.draft_per_row(drafts)
        greedy = torch.tensor([p.greedy for p in params])
        if bool(greedy.all()):
            targets = greedy_tokens(logits)
            accepted = draft_tokens == targets
        else:
            positions = [
                r.num_output_tokens + j
                for r, n in zip(requests, counts, strict=True)
                for j in range(n)
            ]
            targets, accepted = self._sample(logits, rows, positions, greedy, draft_tokens)
        token_ids = rejection.accepted_runs(drafts, targets.tolist(), accepted.tolist())
        if raw_logprobs is not None and len(rows) > len(requests):
            # Requests with logprobs carry no drafts: each has one row, its first.
            first_rows = torch.tensor([0, *counts[:-1]]).cumsum(dim=0)
            raw_logprobs = raw_logprobs.index_select(0, first_rows)
        request_params = [r.sampling_params for r in requests]
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=self._logprobs(raw_logprobs, request_params, [t[0] for t in token_ids]),
        )

    def _process(
        self, logits: torch.Tensor, rows: list[Request], allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """The logits each row samples from: grammar mask, bias, min_tokens, penalties."""
        params = [r.sampling_params for r in rows]
        if allowed is not None:
            # First, so that no bias or penalty can revive a token the grammar forbids.
            logits = logits.masked_fill(~allowed, float("-inf"))
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, params)
        logits = self._apply_min_tokens(logits, rows)
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, rows)
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """OpenAI's logit_bias: added to the raw logits, before penalties and sampling; each
        request's ids and biases are tensors built once with its params."""
        rows = torch.repeat_interleave(torch.tensor([len(p.logit_bias) for p in params]))
        columns = torch.cat([p.logit_bias_ids for p in params])
        values = torch.cat([p.logit_bias_values for p in params]).to(logits.dtype)
        logits = logits.clone()
        logits[rows, columns] += values
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Below min_tokens, EOS and stop tokens cannot be chosen."""
        rows, columns = [], []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens < params.min_tokens:
                banned = params.stop_token_set
                if not params.ignore_eos:
                    banned = banned | request.eos_token_ids
                rows += [row] * len(banned)
                columns += list(banned)
        if rows:
            logits = logits.clone()
            logits[rows, columns] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Presence and frequency count generated tokens; repetition also counts the prompt."""
        num_rows, vocab = logits.shape
        output_counts = torch.zeros(num_rows, vocab, dtype=torch.float32)
        seen = torch.zeros(num_rows, vocab, dtype=torch.bool)
        for row, request in enumerate(requests):
            outputs = torch.tensor(request.output_token_ids, dtype=torch.int64)
            output_counts[row].index_add_(0, outputs, torch.ones(len(outputs)))
            seen[row, torch.tensor(request.all_token_ids, dtype=torch.int64)] = True
        params = [r.sampling_params for r in requests]
        repetition = torch.tensor([p.repetition_penalty for p in params])[:, None]
        presence = torch.tensor([p.presence_penalty for p in params])[:, None]
        frequency = torch.tensor([p.frequency_penalty for p in params])[:, None]
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
        logits = logits - frequency * output_counts - presence * (output_counts > 0).float()
        return logits

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        rows: list[Request],
        positions: list[int],
        greedy: torch.Tensor,
        draft_tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token (for a row that verifies a draft: its replacement, should the draft
        be rejected) and whether the row accepts its draft; ``positions[row]`` is the index
        among its request's output tokens of the token the row samples."""
        params = [r.sampling_params for r in rows]
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        uniform = torch.rand(len(rows))
        has_drafts = bool((draft_tokens != rejection.NO_DRAFT).any())
        probs: torch.Tensor | None
        drawn = sample_rows(
            logits, temperature, top_k, top_p, min_p, uniform, draft_tokens, has_drafts
        )
        if drawn is None:
            probs = torch.softmax(logits / temperature[:, None], dim=-1)
            if bool((min_p > 0).any()) or bool((top_k > 0).any()) or bool((top_p < 1).any()):
                keep_thresholds(probs, top_k, top_p, min_p)
            sampled = _inverse_transform(rejection.without_drafts(probs, draft_tokens), uniform)
        else:
            sampled, probs = drawn
        # Seeded rows race instead, keyed by seed and position (seeding.py says why).
        seeds = {row: p.seed for row, p in enumerate(params) if p.seed is not None and not p.greedy}
        if seeds:
            index = torch.tensor(list(seeds))
            seeded_probs = torch.softmax(logits[index] / temperature[index, None], dim=-1)
            keep_thresholds(seeded_probs, top_k[index], top_p[index], min_p[index])
            sampled[index] = seeding.race(
                seeded_probs, list(seeds.values()), [positions[row] for row in seeds]
            )
        argmax = greedy_tokens(logits)
        if has_drafts:
            assert probs is not None
            chance = torch.rand(len(rows)) < rejection.draft_probs(probs, draft_tokens)
            accepted = torch.where(greedy, draft_tokens == argmax, chance)
        else:
            accepted = torch.zeros(len(rows), dtype=torch.bool)
        return torch.where(greedy, argmax, sampled), accepted

    @staticmethod
    def _logprobs(
        raw_logprobs: torch.Tensor | None, params: list, token_ids: list[int]
    ) -> list[dict[int, float] | None]:
        if raw_logprobs is None:
            return [None] * len(token_ids)
        # Tokens a grammar or ban masks out have -inf: reported at OpenAI's floor, as JSON has
        # no infinity.
        raw_logprobs = raw_logprobs.nan_to_num(nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
        result: list[dict[int, float] | None] = []
        for row, (p, token_id) in enumerate(zip(params, token_ids, strict=True)):
            if p.logprobs is None:
                result.append(None)
                continue
            entry = {token_id: float(raw_logprobs[row, token_id])}
            if p.logprobs > 0:
                values, indices = raw_logprobs[row].topk(p.logprobs)
                entry.update(zip(indices.tolist(), values.tolist(), strict=True))
            result.append(entry)
        return result


def _inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn from its (unnormalized) ``probs`` by one ``uniform`` in [0, 1):
    the first token whose cumulative probability passes ``uniform`` times the row's total. A
    token of probability 0 is never drawn: the cumulative sum does not pass anything there."""
    cumulative = probs.cumsum(dim=-1)
    targets = (uniform * cumulative[:, -1])[:, None]
    tokens = torch.searchsorted(cumulative, targets, right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[1] - 1)


def _takes_the_argmax(request: Request) -> bool:
    """Whether the request's next token is the argmax of its logits as the model gave them:
    greedy, with no bias, penalty or min_tokens ban to apply first, and no logprobs to report."""
    params = request.sampling_params
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and not params.uses_penalties
        and request.num_output_tokens >= params.min_tokens
    )
