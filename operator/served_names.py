"""Served names claimed by pools of different namespaces: reported on every claimant, never decided.

The gateway resolves a model name within what a caller may use; a name two namespaces both claim
is still a conflict to show on both pools (condition ``ServedNameConflict`` and an Event), so
that no one learns of it from traffic going to the other team's pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmpool.operator import conditions as cond


def rivals(claims: Iterable[tuple[str, str]], namespace: str) -> list[str]:
    """``namespace/name`` of the pools in other namespaces among a served name's claims."""
    return sorted({f"{ns}/{name}" for ns, name in claims if ns != namespace})


def served_name_condition(name: str, rival_pools: Sequence[str]) -> cond.Condition:
    if not rival_pools:
        message = f"no pool of another namespace serves {name!r}"
        return cond.Condition(cond.SERVED_NAME_CONFLICT, "False", "Unique", message)
    message = (
        f"served name {name!r} is also claimed by {', '.join(rival_pools)}; the gateway never "
        "picks between namespaces by order: give the pools distinct servedNames, or scope the "
        "callers' keys to one namespace"
    )
    return cond.Condition(cond.SERVED_NAME_CONFLICT, "True", "ClaimedInOtherNamespaces", message)
