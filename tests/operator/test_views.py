"""Pod and Deployment views: what the operator's indexes keep of each object."""

from __future__ import annotations

from llmpool.operator.views import Termination, deployment_view, pod_view


def test_pod_view(make_pod):
    view = pod_view(
        make_pod(
            "chat-1",
            restart_count=2,
            waiting="CrashLoopBackOff",
            ready=False,
            last_terminated={"exitCode": 3, "reason": "Error", "message": "RevisionMismatch: x"},
        )
    )
    assert view.name == "chat-1" and view.uid == "uid-chat-1"
    assert view.digest == "sha256:" + "d" * 64
    assert not view.ready and view.ip == "10.0.0.1" and not view.terminating
    assert view.restart_count == 2
    assert view.waiting_reason == "CrashLoopBackOff"
    assert view.terminated is None
    assert view.last_terminated == Termination(3, "Error", "RevisionMismatch: x")


def test_pending_pod_without_status():
    view = pod_view({"metadata": {"name": "p", "uid": "u"}})
    assert (view.ready, view.ip, view.digest, view.restart_count) == (False, None, None, 0)


def test_other_containers_are_ignored(make_pod):
    body = make_pod("p", restart_count=0)
    body["status"]["containerStatuses"].insert(0, {"name": "sidecar", "restartCount": 9})
    assert pod_view(body).restart_count == 0


def test_deployment_view(make_deployment):
    body = make_deployment(replicas=3, ready=1, updated=2, generation=5, observed_generation=4)
    body["status"]["conditions"] = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]
    view = deployment_view(body)
    assert (view.replicas, view.ready_replicas, view.updated_replicas) == (3, 1, 2)
    assert (view.generation, view.observed_generation) == (5, 4)
    assert view.progress_deadline_exceeded
    assert view.digest == "sha256:" + "d" * 64


def test_new_deployment_without_status():
    view = deployment_view({"metadata": {"generation": 1}, "spec": {"replicas": 2}})
    assert (view.status_replicas, view.ready_replicas, view.observed_generation) == (0, 0, 0)
    assert view.digest is None and not view.progress_deadline_exceeded
