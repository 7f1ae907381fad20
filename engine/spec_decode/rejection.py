"""Verifying draft tokens against the target model's distributions (speculative sampling).

A request with ``k`` drafts has ``k + 1`` logits rows: row ``j`` is the target's distribution
``p_j`` for the token after draft ``j - 1``. The drafts are deterministic (one-hot ``q``), so the
rule of Leviathan et al. reduces to: accept draft ``x`` with probability ``p_j(x)``; at the first
rejection, sample from ``p_j`` without ``x`` (renormalized); after ``k`` acceptances, sample a
bonus token from ``p_k``. Each emitted token then follows ``p`` exactly, as without drafts. For a
greedy request ``p_j`` is one-hot on the argmax: drafts are accepted while they equal it, and the
tokens are those that decoding one at a time would give.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NO_DRAFT = -1  # the draft of a row that verifies none (each request's last row)


def draft_per_row(drafts: Sequence[list[int]]) -> torch.Tensor:
    """The draft token each row verifies: a request's drafts, then ``NO_DRAFT``."""
    return torch.tensor([token for draft in drafts for token in (*draft, NO_DRAFT)])


def without_drafts(probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``probs`` with each row's draft token at zero (what a rejection samples from; the
    sampler's inverse transform needs no renormalizing)."""
    has_draft = draft_tokens != NO_DRAFT
    if not bool(has_draft.any()):
        return probs
    columns = draft_tokens.clamp(min=0)[:, None]
    kept = torch.where(has_draft[:, None], 0.0, probs.gather(1, columns))
    return probs.scatter(1, columns, kept)


def draft_probs(probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """Each row's probability of its draft token (0 for rows without one)."""
    has_draft = draft_tokens != NO_DRAFT
    picked = probs.gather(1, draft_tokens.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(has_draft, picked, 0.0)


def accepted_runs(
    drafts: Sequence[list[int]], targets: list[int], accepted: list[bool]
) -> list[list[int]]:
    """Each request's new tokens: its drafts up to the first rejected one, then the target's
    token of that row (the replacement, or the bonus token when all were accepted)."""
    runs = []
    row = 0
    for draft in drafts:
        num_accepted = 0
        while num_accepted < len(draft) and accepted[row + num_accepted]:
            num_accepted += 1
        runs.append([*draft[:num_accepted], targets[row + num_accepted]])
        row += len(draft) + 1
    return runs
