"""Comparing a live child with what the operator renders: only the rendered fields count."""

from __future__ import annotations

import copy

from llmpool import pinning
from llmpool.operator.children import child_view, differences, drift_message
from llmpool.operator.render import render_deployment, render_service
from llmpool.operator.spec import PoolSpec


def deployment(chat_spec, chat_template) -> dict:
    digest = pinning.pinned_digest(pinning.pinned_from_spec(chat_spec, chat_template))
    return render_deployment("chat", PoolSpec.from_dict(chat_spec), digest, "llmpool:latest")


def as_stored(obj: dict) -> dict:
    """Roughly what the API server returns: the object plus defaults and status."""
    stored = copy.deepcopy(obj)
    stored["metadata"].update(uid="u", resourceVersion="7", generation=2)
    stored["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    stored["metadata"]["managedFields"] = [{"manager": "llmpool-operator"}]
    stored["spec"]["progressDeadlineSeconds"] = 600
    container = stored["spec"]["template"]["spec"]["containers"][0]
    container["terminationMessagePolicy"] = container.get("terminationMessagePolicy", "File")
    container["imagePullPolicy"] = "IfNotPresent"
    container["readinessProbe"]["successThreshold"] = 1
    stored["status"] = {"replicas": 2}
    return stored


def test_server_defaults_are_not_differences(chat_spec, chat_template):
    rendered = deployment(chat_spec, chat_template)
    assert differences(child_view(rendered).body, child_view(as_stored(rendered)).body) == []
    assert drift_message("Deployment", "chat", child_view(as_stored(rendered)), rendered) == ""


def test_quantities_compare_by_value(chat_spec, chat_template):
    spec = {**chat_spec, "resources": {"limits": {"cpu": 4, "memory": "1.5Gi"}}}
    rendered = deployment(spec, chat_template)
    stored = as_stored(rendered)
    stored["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "cpu": "4",
        "memory": "1536Mi",
    }
    assert differences(child_view(rendered).body, child_view(stored).body) == []


def test_an_edited_argument_is_a_difference(chat_spec, chat_template):
    rendered = deployment(chat_spec, chat_template)
    stored = as_stored(rendered)
    args = stored["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--max-model-len") + 1] = "16"
    message = drift_message("Deployment", "chat", child_view(stored), rendered)
    assert message.startswith("Deployment chat differed at ")
    assert ".spec.template.spec.containers[0].args[" in message


def test_an_added_argument_and_a_removed_label_are_differences(chat_spec, chat_template):
    rendered = deployment(chat_spec, chat_template)
    stored = as_stored(rendered)
    stored["spec"]["template"]["spec"]["containers"][0]["args"].append("--debug")
    del stored["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    assert differences(child_view(rendered).body, child_view(stored).body) == [
        ".metadata.labels.app.kubernetes.io/managed-by",
        ".spec.template.spec.containers[0].args",
    ]


def test_a_missing_child():
    assert drift_message("Service", "chat", None, render_service("chat")) == (
        "Service chat was missing"
    )
