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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmpool import names
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
    for (None: the base model), as the pool's spec spells it (the engines know that spelling).

    Names are compared in their normal form (``llmpool.names.normalize``: NFKC, case folded),
    the whole ``model`` normalised before it is split. ``namespace/name`` is resolved in that
    namespace only: its served names, then its adapters; it never matches a bare name (names
    hold no ``/``), so no pool of another namespace takes it, whatever that pool is named. A
    bare name is looked up among the served names of every visible pool, then among their
    adapters. Pools of one namespace may share a name (one per priority class); a bare name
    that pools of two namespaces claim is a 400 naming the qualified ids, never a winner picked
    by sort order. Pools whose names break the grammar (objects stored before the CRD refused
    them) are never matched.
    """
    split = names.split_qualified(model)
    if split is None:
        raise _not_found(pools, model)
    namespace, name = split
    scoped = [p for p in pools if namespace in (None, names.normalize(p.namespace))]
    named = _named(scoped, model, lambda pool: name in _served_names(pool))
    if named:
        return named, None
    named = _named(scoped, model, lambda pool: name in _adapter_names(pool))
    if not named:
        raise _not_found(pools, model)
    return named, _adapter_names(named[0])[name]


def _named(pools: Sequence[Pool], model: str, names_it: Callable[[Pool], bool]) -> list[Pool]:
    """The pools ``names_it`` holds for; a 400 if they are in several namespaces."""
    named = [p for p in pools if names_it(p)]
    namespaces = sorted({p.namespace for p in named})
    if len(namespaces) > 1:
        qualified = ", ".join(f"{namespace}/{model}" for namespace in namespaces)
        raise RoutingError(
            400,
            f"the model {model!r} is served in {len(namespaces)} namespaces; name one: {qualified}",
            MODEL_AMBIGUOUS,
        )
    return named


def _served_names(pool: Pool) -> dict[str, str]:
    """The pool's served name by its normal form; empty if it breaks the grammar."""
    if not names.is_valid_name(pool.served_name):
        return {}
    return {names.normalize(pool.served_name): pool.served_name}


def _adapter_names(pool: Pool) -> dict[str, str]:
    """The pool's adapter names (those that keep the grammar) by their normal form."""
    return {names.normalize(a): a for a in pool.adapters if names.is_valid_name(a)}


def _not_found(pools: Sequence[Pool], model: str) -> RoutingError:
    served = ", ".join([*model_ids(pools), *adapter_ids(pools)]) or "none"
    return RoutingError(
        404, f"the model {model!r} does not exist; served models: {served}", MODEL_NOT_FOUND
    )


def model_ids(pools: Sequence[Pool]) -> list[str]:
    """The ids ``/v1/models`` lists for ``pools`` (those the caller may use): the served name of
    each pool that is Ready or comes up on demand, once (in one spelling, compared normalised);
    a served name claimed in several namespaces is listed as ``namespace/servedName`` for each
    instead, the ids that work."""
    listed: dict[str, str] = {}
    for pool in _listed(pools):
        for served in _served_names(pool).values():
            model_id = _listed_id(pools, pool, served, _served_names)
            normal = names.normalize(model_id)
            listed[normal] = min(listed.get(normal, model_id), model_id)
    return sorted(listed.values())


def adapter_ids(pools: Sequence[Pool]) -> dict[str, str]:
    """The adapters ``/v1/models`` lists, by the same rules as :func:`model_ids`, each with its
    parent: the id its pool's base model is listed under. An adapter named like a served model
    is left out: that name routes to the served model."""
    served = {normal for pool in pools for normal in _served_names(pool)}
    return {
        _listed_id(pools, pool, name, _adapter_names): _listed_id(
            pools, pool, pool.served_name, _served_names
        )
        for pool in _listed(pools)
        for normal, name in sorted(_adapter_names(pool).items())
        if normal not in served
    }


def _listed(pools: Sequence[Pool]) -> list[Pool]:
    return [pool for pool in pools if pool.ready or pool.scales_from_zero]


def _listed_id(
    pools: Sequence[Pool], pool: Pool, name: str, names_of: Callable[[Pool], Mapping[str, str]]
) -> str:
    """``name`` if only one namespace's pools have it among ``names_of(pool)``, else qualified."""
    normal = names.normalize(name)
    if len({p.namespace for p in pools if normal in names_of(p)}) == 1:
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
