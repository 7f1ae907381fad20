"""classify_drift and the Recreate policy's choice of pods."""

from __future__ import annotations

import copy

from llmpool import pinning
from llmpool.operator.drift import (
    DriftEntry,
    Fingerprint,
    Remediation,
    classify_drift,
    entries_from_status,
    pods_to_recreate,
    remediate,
)
from llmpool.operator.views import pod_view

PINNED = pinning.pinned_fields(
    source="builtin://smollm2-135m-instruct",
    revision="sha256:" + "a" * 64,
    served_name="smollm2",
    chat_template="{{ messages }}",
    quantization="none",
    kv_cache_dtype="auto",
    max_model_len=2048,
    block_size=16,
)
DIGEST = pinning.pinned_digest(PINNED)
OLD_DIGEST = "sha256:" + "0" * 64


def body(pinned=None, weights="sha256:w", tokenizer="sha256:t") -> dict:
    pinned = copy.deepcopy(PINNED if pinned is None else pinned)
    return {
        "pinned": pinned,
        "observed": {
            "weightsDigest": weights,
            "tokenizerDigest": tokenizer,
            "dtype": "float32",
            "device": "cpu",
            "engineVersion": "0.1.0",
        },
        "digest": pinning.pinned_digest(pinned),
    }


def fingerprint(pod: str, template_digest: str = DIGEST, **kwargs) -> Fingerprint:
    return Fingerprint(pod=pod, template_digest=template_digest, body=body(**kwargs))


def test_matching_replicas_have_no_drift():
    assert classify_drift([fingerprint("a"), fingerprint("b")], PINNED, DIGEST) == []


def test_a_different_chat_template_is_drift_with_field_detail():
    other = {**PINNED, "chatTemplateSha256": "f" * 64}
    entries = classify_drift([fingerprint("a"), fingerprint("b", pinned=other)], PINNED, DIGEST)
    assert entries == [
        DriftEntry("b", "chatTemplateSha256", PINNED["chatTemplateSha256"], "f" * 64)
    ]


def test_numbers_and_nulls_are_reported_as_text():
    other = {**PINNED, "maxModelLen": 4096, "chatTemplateSha256": None}
    entries = classify_drift([fingerprint("a", pinned=other)], PINNED, DIGEST)
    assert {(e.field, e.actual) for e in entries} == {
        ("chatTemplateSha256", "null"),
        ("maxModelLen", "4096"),
    }
    assert entries[0].as_status()["expected"] == PINNED["chatTemplateSha256"]


OLD_PINNED = {**PINNED, "maxModelLen": 1024}


def test_pods_of_an_older_template_during_a_rollout_are_not_drift():
    old_digest = pinning.pinned_digest(OLD_PINNED)
    fingerprints = [
        fingerprint("new-1"),
        fingerprint("old-1", template_digest=old_digest, pinned=OLD_PINNED, weights="sha256:x"),
        fingerprint("old-2", template_digest=old_digest, pinned=OLD_PINNED, weights="sha256:x"),
    ]
    assert classify_drift(fingerprints, PINNED, DIGEST) == []


def test_an_outgoing_pod_is_judged_against_its_own_templates_pin():
    old_digest = pinning.pinned_digest(OLD_PINNED)
    fingerprints = [
        fingerprint("new-1"),
        fingerprint("old-1", template_digest=old_digest, pinned=OLD_PINNED),
        # Created from the old template but running the new pin: it differs from its own.
        fingerprint("old-2", template_digest=old_digest),
    ]
    assert classify_drift(fingerprints, PINNED, DIGEST) == [
        DriftEntry("old-2", "digest", old_digest, DIGEST)
    ]


def test_a_pinned_change_mid_drift_keeps_the_drifted_pod_and_only_it():
    """Pool on OLD_PINNED with old-b drifted (its chat template differs); then the pin changes.

    Mid-rollout old-a still serves its own pin (no entry), old-b is still drifted against its
    own template, the new replica is clean, and the siblings' weights majority is taken per
    template, so the new pin's other weights flag nobody.
    """
    old_digest = pinning.pinned_digest(OLD_PINNED)
    tampered = {**OLD_PINNED, "chatTemplateSha256": "f" * 64}
    before = [
        fingerprint("old-a", template_digest=old_digest, pinned=OLD_PINNED),
        fingerprint("old-b", template_digest=old_digest, pinned=tampered),
    ]
    entries = classify_drift(before, OLD_PINNED, old_digest)
    assert [(e.pod, e.field) for e in entries] == [("old-b", "chatTemplateSha256")]

    during = [*before, fingerprint("new-a", weights="sha256:new")]
    entries = classify_drift(during, PINNED, DIGEST)
    assert entries == [DriftEntry("old-b", "digest", old_digest, pinning.pinned_digest(tampered))]


def test_weights_differing_from_the_majority_is_drift():
    fingerprints = [fingerprint("a"), fingerprint("b"), fingerprint("c", weights="sha256:evil")]
    assert classify_drift(fingerprints, PINNED, DIGEST) == [
        DriftEntry("c", "observed.weightsDigest", "sha256:w", "sha256:evil")
    ]


def test_tokenizer_minority_is_drift():
    fingerprints = [fingerprint("a"), fingerprint("b", tokenizer="sha256:t2"), fingerprint("c")]
    [entry] = classify_drift(fingerprints, PINNED, DIGEST)
    assert (entry.pod, entry.field) == ("b", "observed.tokenizerDigest")


def test_a_tie_reports_every_pod_without_a_majority():
    entries = classify_drift(
        [fingerprint("a"), fingerprint("b", weights="sha256:x")], PINNED, DIGEST
    )
    assert [(e.pod, e.expected) for e in entries] == [("a", None), ("b", None)]
    assert entries[0].as_status()["expected"] == "(no majority)"


def test_a_digest_computed_differently_is_still_drift():
    skewed = body()
    skewed["digest"] = "sha256:" + "9" * 64
    entries = classify_drift([Fingerprint("a", DIGEST, skewed)], PINNED, DIGEST)
    assert entries == [DriftEntry("a", "digest", None, skewed["digest"])]


def pods(make_pod, *specs):
    return [pod_view(make_pod(name, digest=DIGEST, **kwargs)) for name, kwargs in specs]


def drifted(*names: str, expected: str | None = "x") -> list[DriftEntry]:
    return [DriftEntry(name, "chatTemplateSha256", expected, "y") for name in names]


def test_recreate_one_pod_at_a_time(make_pod):
    views = pods(make_pod, ("a", {}), ("b", {}), ("c", {}))
    chosen = pods_to_recreate(
        drifted("b", "c"),
        views,
        digest=DIGEST,
        replicas=3,
        max_unavailable=2,
        rollout_in_progress=False,
    )
    assert chosen == ["b"]


def test_never_during_a_rollout(make_pod):
    views = pods(make_pod, ("a", {}), ("b", {}))
    assert (
        pods_to_recreate(
            drifted("b"),
            views,
            digest=DIGEST,
            replicas=2,
            max_unavailable=1,
            rollout_in_progress=True,
        )
        == []
    )


def test_never_beyond_max_unavailable(make_pod):
    one_down = pods(make_pod, ("a", {}), ("b", {"ready": False}), ("c", {}))
    kwargs = dict(digest=DIGEST, replicas=3, rollout_in_progress=False)
    assert pods_to_recreate(drifted("c"), one_down, max_unavailable=1, **kwargs) == []
    assert pods_to_recreate(drifted("c"), one_down, max_unavailable=2, **kwargs) == ["c"]
    all_up = pods(make_pod, ("a", {}), ("b", {}), ("c", {}))
    assert pods_to_recreate(drifted("c"), all_up, max_unavailable=0, **kwargs) == []


def test_a_terminating_pod_counts_as_unavailable_and_is_not_chosen_again(make_pod):
    views = pods(make_pod, ("a", {"deleting": True}), ("b", {}))
    kwargs = dict(digest=DIGEST, replicas=2, max_unavailable=1, rollout_in_progress=False)
    assert pods_to_recreate(drifted("a", "b"), views, **kwargs) == []


def test_ties_are_never_recreated(make_pod):
    views = pods(make_pod, ("a", {}), ("b", {}))
    kwargs = dict(digest=DIGEST, replicas=2, max_unavailable=1, rollout_in_progress=False)
    assert pods_to_recreate(drifted("a", "b", expected=None), views, **kwargs) == []


def test_remediation_backs_off_after_max_attempts():
    entries = drifted("b")
    kwargs = dict(checked=2, replicas=2, max_attempts=3)
    first = remediate(entries, ["b"], attempts=0, **kwargs)
    assert (first.victims, first.attempts, first.gave_up) == (["b"], 1, None)
    third = remediate(entries, ["b"], attempts=2, **kwargs)
    assert (third.victims, third.attempts, third.gave_up) == (["b"], 3, None)
    spent = remediate(entries, ["b"], attempts=3, **kwargs)
    assert (spent.victims, spent.attempts) == ([], 3)
    assert spent.gave_up is not None
    assert "3 recreation(s)" in spent.gave_up
    assert "pod b: chatTemplateSha256 is y, expected x" in spent.gave_up


def test_remediation_resets_once_every_replica_checks_clean():
    clean = remediate([], [], checked=2, replicas=2, attempts=3, max_attempts=3)
    assert clean == Remediation([], 0, None)


def test_a_partial_clean_check_keeps_the_count():
    """The replacement is still starting, or only its healthy sibling answered."""
    partial = remediate([], [], checked=1, replicas=2, attempts=2, max_attempts=3)
    assert partial == Remediation([], 2, None)


def test_remediation_waits_without_spending_attempts():
    waiting = remediate(drifted("b"), [], checked=2, replicas=2, attempts=1, max_attempts=3)
    assert (waiting.victims, waiting.attempts, waiting.gave_up) == ([], 1, None)


def test_status_entries_read_back():
    entries = [DriftEntry("a", "observed.weightsDigest", None, None), *drifted("b")]
    assert entries_from_status([e.as_status() for e in entries]) == entries
