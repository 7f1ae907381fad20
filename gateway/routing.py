"""Routing decisions as pure functions: which pool serves a request, and which replica runs it.

Prefix affinity: the key is a hash of the first ``prefix_chars`` characters of the request's
raw prompt (the completion prompt, or the chat messages as ``role: content`` lines; not the
rendered chat template, which only the engine knows). Replicas are ranked for a key by
rendezvous hashing, so a key keeps its replica while replicas come and go elsewhere, and every
gateway replica ranks alike without sharing state. The first-ranked replica takes the request
unless its load is at the bound of consistent hashing with bounded loads,
``ceil(load_factor * (total load + 1) / replicas)``; then the least-loaded replica does, chosen
at random among ties.

A request may name a LoRA adapter a pool declares (``spec.adapters``) instead of its served
name. It goes only to replicas whose /fingerprint shows that adapter loaded with the files the
pool pins, and its affinity key includes the adapter's name: each replica caches prefixes per
adapter, so one adapter's requests sharing a prefix meet on one replica, and several adapters
behind the same system prompt spread over the replicas.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmpool.gateway.pools import Pool, Replica
from llmpool.protocol.priority import PRIORITY_CLASSES

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
ADAPTER_NOT_RESIDENT = "adapter_not_resident"
# A request is held (up to the hold timeout) on these: a replica or an adapter load may come.
HELD_CODES = frozenset({NO_READY_REPLICA, ADAPTER_NOT_RESIDENT})


class RoutingError(Exception):
    """No replica can take the request; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def prompt_text(body: Mapping[str, Any]) -> str:
    """The raw prompt of a completions, chat or Responses body, as text in the order the model
    reads it."""
    if "input" in body:  # /v1/responses: its instructions come first
        return json.dumps([body.get("instructions"), body["input"]], ensure_ascii=False)
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


def affinity_key(prefix: bytes, adapter: str | None) -> bytes:
    """The key replicas are ranked by: the prefix key for the base model, the adapter's name
    and the prefix key for an adapter."""
    if adapter is None:
        return prefix
    return hashlib.blake2b(adapter.encode() + b"\0" + prefix, digest_size=16).digest()


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


def resolve(pools: Sequence[Pool], model: str) -> tuple[list[Pool], str | None]:
    """The pools, among those the caller may use, that ``model`` names, and the adapter it asks
    for (None: the base model).

    By served name, or as ``namespace/servedName``; failing that, by the name of an adapter in
    ``spec.adapters``, bare or qualified alike (the adapter comes back bare, as the engines know
    it). Pools of one namespace may share a name (one per priority class); pools of two
    namespaces sharing one make the bare name ambiguous: a 400 naming the qualified names, never
    a winner picked by sort order.
    """
    named = _named(pools, model, lambda pool, name: pool.served_name == name)
    if named:
        return named, None
    named = _named(pools, model, lambda pool, name: name in pool.adapters)
    if not named:
        raise _not_found(pools, model)
    adapter = model if model in named[0].adapters else model.split("/", 1)[1]
    return named, adapter


def _named(pools: Sequence[Pool], model: str, names: Callable[[Pool, str], bool]) -> list[Pool]:
    """The pools ``names(pool, model)`` holds for, else those of ``namespace/name``; a 400 if
    they are in several namespaces."""
    named = [p for p in pools if names(p, model)]
    if not named and "/" in model:
        namespace, name = model.split("/", 1)
        named = [p for p in pools if p.namespace == namespace and names(p, name)]
    namespaces = sorted({p.namespace for p in named})
    if len(namespaces) > 1:
        qualified = ", ".join(f"{namespace}/{model}" for namespace in namespaces)
        raise RoutingError(
            400,
            f"the model {model!r} is served in {len(namespaces)} namespaces; name one: {qualified}",
            MODEL_AMBIGUOUS,
        )
    return named


def _not_found(pools: Sequence[Pool], model: str) -> RoutingError:
    served = ", ".join([*model_ids(pools), *adapter_ids(pools)]) or "none"
    return RoutingError(
        404, f"the model {model!r} does not exist; served models: {served}", MODEL_NOT_FOUND
    )


def model_ids(pools: Sequence[Pool]) -> list[str]:
    """The ids ``/v1/models`` lists for ``pools`` (those the caller may use): the served name of
    each pool that is Ready or comes up on demand, once; a served name claimed in several
    namespaces is listed as ``namespace/servedName`` for each instead, the ids that work."""
    return sorted({_listed_id(pools, p, p.served_name, _served_name) for p in _listed(pools)})


def adapter_ids(pools: Sequence[Pool]) -> dict[str, str]:
    """The adapters ``/v1/models`` lists, by the same rules as :func:`model_ids`, each with its
    parent: the id its pool's base model is listed under. An adapter named like a served model
    is left out: that name routes to the served model."""
    served = {p.served_name for p in pools}
    return {
        _listed_id(pools, pool, name, lambda p: p.adapters): _listed_id(
            pools, pool, pool.served_name, _served_name
        )
        for pool in _listed(pools)
        for name in sorted(pool.adapters)
        if name not in served
    }


def _listed(pools: Sequence[Pool]) -> list[Pool]:
    return [pool for pool in pools if pool.ready or pool.scales_from_zero]


def _served_name(pool: Pool) -> set[str]:
    return {pool.served_name}


def _listed_id(
    pools: Sequence[Pool], pool: Pool, name: str, names: Callable[[Pool], Collection[str]]
) -> str:
    """``name`` if only one namespace's pools have it among ``names(pool)``, else qualified."""
    if len({p.namespace for p in pools if name in names(p)}) == 1:
        return name
    return f"{pool.namespace}/{name}"


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
    adapters: Mapping[str, str] | None = None  # from its /fingerprint: name -> digest


def routable(
    pool: Pool, candidates: Sequence[Candidate], adapter: str | None = None
) -> list[Candidate]:
    """The replicas that may take traffic: none listed in status.drift, none whose digest differs
    from its own pin (``drifted``); for an adapter, only those that have it loaded with the
    revision the pool pins and are not in drift for it.

    Raises a 503 when there are replicas but every one of them drifted, or when there are none;
    for an adapter, when none of the healthy replicas has it (yet).
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
    if adapter is None:
        return healthy
    resident = [c for c in healthy if has_adapter(pool, c, adapter)]
    if not resident:
        raise RoutingError(
            503,
            f"no ready replica of pool {pool.label} has adapter {adapter!r} loaded at revision"
            f" {pool.adapters.get(adapter)}; retry later",
            ADAPTER_NOT_RESIDENT,
        )
    return resident


def has_adapter(pool: Pool, candidate: Candidate, adapter: str) -> bool:
    """Loaded there with the files the pool pins, and not in drift for it."""
    revision = pool.adapters.get(adapter)
    loaded = (candidate.adapters or {}).get(adapter)
    return (
        revision is not None
        and loaded == revision
        and (candidate.replica.name, adapter) not in pool.adapter_drift
    )


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
