"""RBAC: the operator's rules, in one place, with nothing it does not need."""

from __future__ import annotations

import yaml

from llmpool.operator import rbac


def allowed(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_operator_can_do_its_job():
    granted = allowed(rbac.operator_rules(clusterwide=True))
    needed = {
        ("llmpool.dev", "llmpools", "watch"),
        ("llmpool.dev", "llmpools", "patch"),
        ("llmpool.dev", "llmpools/status", "patch"),
        ("apps", "deployments", "patch"),
        ("apps", "deployments", "watch"),
        ("", "services", "patch"),
        ("", "configmaps", "get"),
        ("", "configmaps", "patch"),
        ("", "pods", "watch"),
        ("", "pods", "delete"),
        ("", "pods", "patch"),
        ("policy", "poddisruptionbudgets", "patch"),
        ("policy", "poddisruptionbudgets", "watch"),
        ("", "events", "create"),
        ("kopf.dev", "clusterkopfpeerings", "patch"),
    }
    assert needed <= granted


def test_least_privilege():
    for clusterwide in (True, False):
        rules = rbac.operator_rules(clusterwide=clusterwide)
        granted = allowed(rules)
        assert not any("*" in part for triple in granted for part in triple)
        resources = {resource for _, resource, _ in granted}
        # Secrets: only to apply and restore each pool's engine-key Secret; never deleted.
        assert {verb for _, r, verb in granted if r == "secrets"} == {
            "get",
            "list",
            "watch",
            "create",
            "patch",
        }
        assert not resources & {"namespaces", "customresourcedefinitions", "nodes", "roles"}
        assert not any(
            verb in ("delete", "deletecollection") for _, r, verb in granted if r != "pods"
        )
        assert not any(
            verb in ("update", "escalate", "bind", "impersonate") for *_, verb in granted
        )


def test_namespaced_operators_peer_per_namespace():
    namespaced = {r for _, r, _ in allowed(rbac.operator_rules(clusterwide=False))}
    clusterwide = {r for _, r, _ in allowed(rbac.operator_rules(clusterwide=True))}
    assert "kopfpeerings" in namespaced and "clusterkopfpeerings" not in namespaced
    assert "clusterkopfpeerings" in clusterwide and "kopfpeerings" not in clusterwide


def test_manifests():
    cluster_role = rbac.role_manifest("op", namespace=None)
    assert cluster_role["kind"] == "ClusterRole" and "namespace" not in cluster_role["metadata"]
    role = rbac.role_manifest("op", namespace="team")
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "team"
    assert role["rules"] == rbac.operator_rules(clusterwide=False)


def test_cli_writes_the_chart_data(capsys):
    assert rbac.main(["--chart-data"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data == rbac.chart_data()


def test_the_charts_copy_is_current(repo_root):
    """charts/llmpool/files/operator-rbac.yaml, when the chart has it, equals the generated one."""
    copy = repo_root / "charts" / "llmpool" / "files" / "operator-rbac.yaml"
    if not copy.exists():
        import pytest

        pytest.skip("the chart does not carry operator-rbac.yaml yet")
    assert yaml.safe_load(copy.read_text()) == rbac.chart_data()
