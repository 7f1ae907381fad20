"""Routing decisions as pure functions: which pool serves a request, and which replica runs it.

Prefix affinity: the key is a hash of the first ``prefix_chars`` characters of the request's
raw prompt (the completion prompt, or the chat messages as ``role: content`` lines; not the
rendered chat template, which only the engine knows). Replicas are ranked for a key by
rendezvous hashing, so a key keeps its replica while replicas come and go elsewhere, and every
gateway replica ranks alike without sharing state. The first-ranked replica takes the request
unless its load is at the bound of consistent hashing with bounded loads,
``ceil(load_factor * (total load + 1) / replicas)``; then the least-loaded replica does, chosen
at random among ties.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmpool.engine.priority import PRIORITY_CLASSES
from llmpool.gateway.pools import Pool, Replica

DEFAULT_PREFIX_CHARS = 1024  # ~256 tokens: the first 16 KV blocks of 16 tokens
DEFAULT_LOAD_FACTOR = 1.25  # KubeAI's and the CHWBL paper's bound
DEFAULT_PRIORITY_CLASS = "interactive"

AFFINITY = "affinity"  # the key's first-ranked replica
SPILL = "spill"  # the first-ranked replica was at its bound: least-loaded instead
RETRY = "retry"  # another replica after a connect error or a 503 before the first byte

MODEL_NOT_FOUND = "model_not_found"
MODEL_AMBIGUOUS = "model_ambiguous"
NO_READY_REPLICA = "no_ready_replica"
REPLICAS_DRIFTED = "replicas_drifted"


class RoutingError(Exception):
    """No replica can take the request; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def prompt_text(body: Mapping[str, Any]) -> str:
    """The raw prompt of a completions or chat body, as text in the order the model reads it."""
    if "messages" in body:
        lines = []
        for message in body.get("messages") or []:
            if isinstance(message, Mapping):
                lines.append(f"{message.get('role')}: {_content_text(message.get('content'))}")
        return "\n".join(lines)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: the first one's replica serves them all
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""


def prefix_key(text: str, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> bytes:
    return hashlib.blake2b(text[:prefix_chars].encode("utf-8", "replace"), digest_size=16).digest()


def requested_class(body_priority: Any, header: str | None) -> str | None:
    """The priority class asked for: the body's ``priority`` first, then the header.

    A class name is taken as is; an integer (vLLM's priority, lower runs first) maps to the
    class with the largest priority not above it.
    """
    value = body_priority if body_priority is not None else header
    if value is None:
        return None
    if isinstance(value, str) and value in PRIORITY_CLASSES:
        return value
    try:
        number = int(value)
    except (TypeError, ValueError):
        names = ", ".join(PRIORITY_CLASSES)
        raise RoutingError(
            400, f"priority must be an integer or one of {names}, got {value!r}", "invalid_priority"
        ) from None
    fitting = [name for name, rank in PRIORITY_CLASSES.items() if rank <= number]
    return max(fitting, key=PRIORITY_CLASSES.__getitem__) if fitting else DEFAULT_PRIORITY_CLASS


def pools_named(pools: Sequence[Pool], model: str) -> list[Pool]:
    """The pools, among those the caller may use, that ``model`` names: by served name, or as
    ``namespace/servedName``. Pools of one namespace may share a served name (one per priority
    class); pools of two namespaces sharing one make the bare name ambiguous: a 400 naming the
    qualified names, never a winner picked by sort order.
    """
    named = [p for p in pools if p.served_name == model]
    if not named and "/" in model:
        namespace, served_name = model.split("/", 1)
        named = [p for p in pools if (p.namespace, p.served_name) == (namespace, served_name)]
    if not named:
        served = ", ".join(model_ids(pools)) or "none"
        raise RoutingError(
            404, f"the model {model!r} does not exist; served models: {served}", MODEL_NOT_FOUND
        )
    namespaces = sorted({p.namespace for p in named})
    if len(namespaces) > 1:
        qualified = ", ".join(f"{namespace}/{model}" for namespace in namespaces)
        raise RoutingError(
            400,
            f"the model {model!r} is served in {len(namespaces)} namespaces; name one: {qualified}",
            MODEL_AMBIGUOUS,
        )
    return named


def model_ids(pools: Sequence[Pool]) -> list[str]:
    """The ids ``/v1/models`` lists for ``pools`` (those the caller may use): the served name of
    each pool that is Ready or comes up on demand, once; a served name claimed in several
    namespaces is listed as ``namespace/servedName`` for each instead, the ids that work."""
    namespaces: dict[str, set[str]] = {}
    for pool in pools:
        namespaces.setdefault(pool.served_name, set()).add(pool.namespace)
    listed = {
        pool.served_name if len(namespaces[pool.served_name]) == 1 else pool_model_id(pool)
        for pool in pools
        if pool.ready or pool.scales_from_zero
    }
    return sorted(listed)


def pool_model_id(pool: Pool) -> str:
    return f"{pool.namespace}/{pool.served_name}"


def choose_pool(pools: Sequence[Pool], wanted: str | None) -> Pool:
    """The pool of the wanted class (the interactive one without a wish), Ready ones first.

    A model served by pools of other classes only is still served: by one of those.
    """
    if not pools:
        raise ValueError("choose_pool needs at least one pool")
    wanted = wanted or DEFAULT_PRIORITY_CLASS
    return min(pools, key=lambda p: (p.priority_class != wanted, not p.ready, p.key))


@dataclass(frozen=True)
class Candidate:
    replica: Replica
    load: float
    digest: str | None  # from its /fingerprint; None: not known yet


def routable(pool: Pool, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The replicas that may take traffic: none listed in status.drift, none whose digest differs
    from its own pin (``drifted``).

    Raises a 503 when there are replicas but every one of them drifted, or when there are none.
    """
    if not candidates:
        raise RoutingError(503, f"pool {pool.label} has no ready replica", NO_READY_REPLICA)
    healthy = [c for c in candidates if not drifted(pool, c)]
    if not healthy:
        raise RoutingError(
            503,
            f"every ready replica of pool {pool.label} drifted from its pin; retry later",
            REPLICAS_DRIFTED,
        )
    return healthy


def drifted(pool: Pool, candidate: Candidate) -> bool:
    """Listed in status.drift, or serving a digest other than its own template's pin.

    During a rollout an outgoing replica is held to the pin of the template it was created
    from (status.outgoing), so it keeps serving until it is replaced: a rollout is not drift.
    """
    if candidate.replica.name in pool.drifted:
        return True
    own_pin = pool.outgoing.get(candidate.replica.name, pool.pinned_digest)
    return None not in (candidate.digest, own_pin) and candidate.digest != own_pin


def rank(key: bytes, replicas: Sequence[Candidate]) -> list[Candidate]:
    """Rendezvous (highest random weight) order of the replicas for a key."""

    def weight(candidate: Candidate) -> bytes:
        return hashlib.blake2b(key + candidate.replica.name.encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


def load_bound(candidates: Sequence[Candidate], load_factor: float) -> float:
    total = sum(c.load for c in candidates)
    return math.ceil(load_factor * (total + 1) / len(candidates))


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # AFFINITY, SPILL or RETRY


def choose_replica(
    key: bytes,
    candidates: Sequence[Candidate],
    *,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    rng: random.Random | None = None,
) -> Decision:
    """The key's first-ranked replica unless its load is at the bound, else the least loaded."""
    if not candidates:
        raise ValueError("choose_replica needs at least one candidate")
    preferred = rank(key, candidates)[0]
    if preferred.load + 1 <= load_bound(candidates, load_factor):
        return Decision(preferred.replica, AFFINITY)
    lowest = min(c.load for c in candidates)
    ties = [c for c in candidates if c.load == lowest]
    return Decision((rng or random).choice(ties).replica, SPILL)
