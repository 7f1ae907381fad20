"""Served names claimed by pools of different namespaces: reported on every claimant, never decided.

The gateway resolves a model name within what a caller may use; a name two namespaces both claim
is still a conflict to show on both pools (condition ``ServedNameConflict`` and an Event), so
that no one learns of it from traffic going to the other team's pool. Claims are qualified
(namespace and pool) and keyed by the served name's normal form, as the gateway compares names:
``Chat`` in one namespace and ``chat`` in another are one name claimed twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from llmpool import names
from llmpool.operator import conditions as cond


def rivals(
    claims: Mapping[str, Iterable[tuple[str, str]]], served_name: str, namespace: str
) -> list[str]:
    """``namespace/name`` of the pools in other namespaces that claim ``served_name``, in any
    spelling of it (``claims``: every pool's (namespace, name) by normalised served name)."""
    claimed = claims.get(names.normalize(served_name), [])
    return sorted({f"{ns}/{name}" for ns, name in claimed if ns != namespace})


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
