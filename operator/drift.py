"""Which replicas drifted from the pin, and which of them policy Recreate may delete now."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmpool.operator.views import PodView
from llmpool.pinning import PINNED_KEYS

# Observed fields that must agree across siblings (they are not part of the pin itself).
OBSERVED_MAJORITY_FIELDS = ("weightsDigest", "tokenizerDigest")
NO_MAJORITY = "(no majority)"
MISSING = "(missing)"
MAX_LISTED_ENTRIES = 5


@dataclass(frozen=True)
class Fingerprint:
    """One replica's answer to GET /fingerprint, with the digest its pod template carries."""

    pod: str
    template_digest: str | None
    body: Mapping[str, Any]


@dataclass(frozen=True)
class DriftEntry:
    pod: str
    field: str
    expected: str | None  # None: siblings disagree without a majority
    actual: str | None

    def as_status(self) -> dict[str, str]:
        return {
            "pod": self.pod,
            "field": self.field,
            "expected": NO_MAJORITY if self.expected is None else self.expected,
            "actual": MISSING if self.actual is None else self.actual,
        }


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _pinned_entries(pod: str, reported: Mapping[str, Any], expected: Mapping[str, Any]) -> list:
    pinned = reported.get("pinned") or {}
    keys = [*PINNED_KEYS, *sorted(set(pinned) - set(PINNED_KEYS))]
    entries = [
        DriftEntry(pod, key, _text(expected.get(key)), _text(pinned.get(key)))
        for key in keys
        if pinned.get(key) != expected.get(key)
    ]
    # A digest that differs while every field agrees: the engine hashes differently.
    return entries or [DriftEntry(pod, "digest", None, _text(reported.get("digest")))]


def _majority_entries(fingerprints: Sequence[Fingerprint], field: str) -> list[DriftEntry]:
    values = {f.pod: (f.body.get("observed") or {}).get(field) for f in fingerprints}
    counts = Counter(values.values())
    if len(counts) <= 1:
        return []
    majority, count = counts.most_common(1)[0]
    has_majority = count * 2 > len(values)
    expected = _text(majority) if has_majority else None
    return [
        DriftEntry(pod, f"observed.{field}", expected, _text(actual))
        for pod, actual in sorted(values.items())
        if not has_majority or actual != majority
    ]


def classify_drift(
    fingerprints: Iterable[Fingerprint], expected_pinned: Mapping[str, Any], expected_digest: str
) -> list[DriftEntry]:
    """Drift entries of the replicas, each judged against the pin of its own pod template.

    A pod of an older template (a rollout in progress) is outgoing, not drifted: it is held to
    the digest its template carries, so only a replica that runs something other than its own
    template's pin is reported, with field detail where its template is the current one (the
    older pin's fields are not known here). The sibling majority of observed digests is taken
    among the pods of one template, since a new pin may change the weights.
    """
    by_template: dict[str, list[Fingerprint]] = {}
    for fingerprint in fingerprints:
        if fingerprint.template_digest is not None:
            by_template.setdefault(fingerprint.template_digest, []).append(fingerprint)
    entries: list[DriftEntry] = []
    for template_digest, siblings in by_template.items():
        for fingerprint in siblings:
            actual = fingerprint.body.get("digest")
            if actual == template_digest:
                continue
            if template_digest == expected_digest:
                entries += _pinned_entries(fingerprint.pod, fingerprint.body, expected_pinned)
            else:
                entries.append(
                    DriftEntry(fingerprint.pod, "digest", template_digest, _text(actual))
                )
        for field in OBSERVED_MAJORITY_FIELDS:
            entries += _majority_entries(siblings, field)
    return sorted(entries, key=lambda e: (e.pod, e.field))


def drifted_pods(entries: Iterable[DriftEntry]) -> list[str]:
    return sorted({e.pod for e in entries})


def pods_to_recreate(
    entries: Sequence[DriftEntry],
    pods: Sequence[PodView],
    *,
    digest: str,
    replicas: int,
    max_unavailable: int,
    rollout_in_progress: bool,
) -> list[str]:
    """At most one drifted pod to delete now, or none.

    Never during a rollout; never when deleting one more pod would leave more than
    ``max_unavailable`` replicas unavailable; never a pod whose only fault is a tie between
    siblings (there is no telling which side is right).
    """
    if rollout_in_progress:
        return []
    available = sum(1 for p in pods if p.ready and not p.terminating and p.digest == digest)
    unavailable = max(replicas - available, 0)
    if unavailable + 1 > max_unavailable:
        return []
    live = {p.name for p in pods if not p.terminating}
    candidates = sorted({e.pod for e in entries if e.expected is not None and e.pod in live})
    return candidates[:1]


@dataclass(frozen=True)
class Remediation:
    """What policy Recreate does after a check, and the attempt count to record in status."""

    victims: list[str]
    attempts: int
    gave_up: str | None  # the Degraded/DriftPersists message once the attempts are spent


def persists_message(entries: Sequence[DriftEntry], attempts: int) -> str:
    details = "; ".join(
        f"pod {e.pod}: {e.field} is {e.actual}, expected {e.expected or '(no majority)'}"
        for e in entries[:MAX_LISTED_ENTRIES]
    )
    more = len(entries) - MAX_LISTED_ENTRIES
    suffix = f" and {more} more" if more > 0 else ""
    return (
        f"{attempts} recreation(s) of drifted pods did not remove the drift; no more pods are "
        f"deleted until a check finds none or the pin changes: {details}{suffix}"
    )


def remediate(
    entries: Sequence[DriftEntry],
    candidates: Sequence[str],
    *,
    checked: int,
    replicas: int,
    attempts: int,
    max_attempts: int,
) -> Remediation:
    """Back off: delete ``candidates`` (``pods_to_recreate``) only while fewer than
    ``max_attempts`` recreations have failed to clear the drift.

    ``attempts`` counts recreations since the pool was last seen drift-free, that is with
    every one of its ``replicas`` checked and none drifted (a replacement still starting, or a
    healthy sibling alone, proves nothing). It is kept in status, so that an operator restart
    does not grant a fresh set of deletions.
    """
    if not entries:
        return Remediation([], 0 if checked >= replicas else attempts, None)
    if attempts >= max_attempts:
        return Remediation([], attempts, persists_message(entries, attempts))
    victims = list(candidates)[: max_attempts - attempts]
    return Remediation(victims, attempts + len(victims), None)


def entries_from_status(drift: Sequence[Mapping[str, Any]]) -> list[DriftEntry]:
    """The drift report kept in status, back as entries (``DriftEntry.as_status`` reversed)."""
    return [
        DriftEntry(
            pod=item.get("pod", ""),
            field=item.get("field", ""),
            expected=None if item.get("expected") == NO_MAJORITY else item.get("expected"),
            actual=None if item.get("actual") == MISSING else item.get("actual"),
        )
        for item in drift
    ]
