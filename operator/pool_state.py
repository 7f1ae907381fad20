"""What the operator remembers about one pool between passes, in its kopf memo.

Only what an operator restart may lose: a restarted operator starts from an empty
``PoolState`` and that costs at most one extra look, never a different decision. It checks the
fingerprints at once (no ``pods_signature``, no ``last_drift_check``), re-reads the chat
template (no cache), compares the children with the indexes at once (no ``applied_at``: the
indexes it starts with show every earlier apply), retries refused adapter loads once (no
``adapter_retry_at``) and sends a spec the API server refused once more, to be refused again
(no ``rejected``).

Everything a restarted operator must decide exactly as the one before it is kept in the pool's
status instead: the pin last applied (``observedGeneration``, ``pinnedDigest``, ``pinned``), the
drift report (``drift``), the recreations of drifted pods already spent (``driftRecreations``:
a restart must not grant a fresh set of deletions) and the autoscaler's window and timers
(``autoscaling``: a restart mid-window must not scale early or late).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmpool.operator.spec import AdapterSpec, ChatTemplateRef, LoraSettings

NEVER = float("-inf")

PodsSignature = tuple[tuple[str, bool, int], ...]
# What makes a fingerprint check due at once when it changes: the pods (each pod's uid,
# readiness and restart count), the LoRA slots and the adapters of the spec.
CheckSignature = tuple[PodsSignature, LoraSettings | None, tuple[AdapterSpec, ...]]


@dataclass(frozen=True)
class Rejection:
    """The API server refused a child of this pin (422): the same spec gets the same answer."""

    generation: int
    digest: str
    message: str


@dataclass(frozen=True)
class PoolState:
    """One pool's memory; times are ``time.monotonic()`` seconds."""

    applied_at: float = NEVER  # the last apply of a child
    rejected: Rejection | None = None
    chat_template: tuple[ChatTemplateRef, str] | None = None  # the template last read
    check_signature: CheckSignature | None = None  # as of the last fingerprint check
    last_drift_check: float = NEVER
    adapter_retry_at: float = NEVER  # refused adapter loads were last tried again
