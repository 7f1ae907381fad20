"""The chart's gateway: Deployment, Service llmpool-gateway:8080, RBAC, values, notes.

Renders through test_chart.py's helpers (loaded from its file: tests/ is not a package).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from llmpool.operator import naming

_spec = importlib.util.spec_from_file_location(
    "llmpool_chart_helpers", Path(__file__).with_name("test_chart.py")
)
assert _spec is not None and _spec.loader is not None
chart = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chart
_spec.loader.exec_module(chart)

pytestmark = chart.pytestmark  # skipped, as the other chart tests, without a helm binary
NAMESPACE, RELEASE = chart.NAMESPACE, chart.RELEASE
GATEWAY = f"{RELEASE}-llmpool-gateway"
READ = ["get", "list", "watch"]
# Never a write to a pool: held requests go to the status of the pool's LLMPoolDemand only.
DEMAND_RULE = {
    "apiGroups": [naming.GROUP],
    "resources": [f"{naming.DEMAND_PLURAL}/status"],
    "verbs": ["patch"],
}
EXPECTED_RULES = [
    {"apiGroups": [naming.GROUP], "resources": [naming.PLURAL], "verbs": READ},
    DEMAND_RULE,
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ},
]
DEFAULT_ARGS = [
    "gateway", "--port=8080", "--hold-timeout=120", "--max-held=256", "--max-requests=1024",
    "--max-buffered-body-mib=128", "--replicas=2",
]  # fmt: skip
FLEET_KEY_DIR = "/var/run/secrets/llmpool/fleet-key"


def gateway_objects(**values: Any) -> dict[str, list[dict[str, Any]]]:
    """The gateway's rendered objects by kind."""
    found: dict[str, list[dict[str, Any]]] = {}
    for document in chart.render(**values):
        if chart.is_gateway(document):
            found.setdefault(document["kind"], []).append(document)
    return found


def test_the_service_is_llmpool_gateway_on_8080_selecting_the_gateway_pods() -> None:
    objects = gateway_objects()
    (service,) = objects["Service"]
    (deployment,) = objects["Deployment"]
    assert service["metadata"] == {**service["metadata"], "name": "llmpool-gateway"}
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    # The operator's Deployment must not select gateway pods, nor the gateway operator pods.
    operator = chart.one(chart.render(), "Deployment")
    assert not operator["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    operator_pods = operator["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= operator_pods.items()


def test_the_deployment_runs_llmpool_gateway_safely() -> None:
    (deployment,) = gateway_objects()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == DEFAULT_ARGS
    assert container["image"] == "ghcr.io/llmpool/llmpool:0.1.0"
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    context = container["securityContext"]
    assert context["runAsUser"] == 10001 and context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]
    (account,) = gateway_objects()["ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] == GATEWAY


def test_two_replicas_by_default_and_evictions_take_one_at_a_time() -> None:
    objects = gateway_objects()
    (deployment,) = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    (budget,) = objects["PodDisruptionBudget"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]

    # A stopped replica keeps serving while its endpoint goes, then relays what it holds for
    # longer than an engine drains (rollout.drainSeconds, 120 by default).
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5
    assert pod["terminationGracePeriodSeconds"] > 120


def test_replicas_and_resources_follow_the_values() -> None:
    resources = {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    (deployment,) = gateway_objects(
        gateway={"enabled": True, "replicas": 3, "resources": resources}
    )["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"] == resources


def test_clusterwide_rbac_reads_pools_and_endpointslices_and_writes_demand_status_only() -> None:
    objects = gateway_objects()
    (role,) = objects["ClusterRole"]
    assert role["rules"] == EXPECTED_RULES
    (binding,) = objects["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}
    ]
    assert "Role" not in objects and "RoleBinding" not in objects


def test_watched_namespaces_get_a_role_each_and_the_flags() -> None:
    watched = ["team-a", "team-b"]
    objects = gateway_objects(watchNamespaces=watched)
    assert "ClusterRole" not in objects and "ClusterRoleBinding" not in objects
    assert sorted(r["metadata"]["namespace"] for r in objects["Role"]) == watched
    assert all(r["rules"] == EXPECTED_RULES for r in objects["Role"])
    assert sorted(b["metadata"]["namespace"] for b in objects["RoleBinding"]) == watched
    (deployment,) = objects["Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == [*DEFAULT_ARGS, "--namespace=team-a", "--namespace=team-b"]


def test_without_demand_records_the_gateway_only_reads_pools() -> None:
    objects = gateway_objects(gateway={"enabled": True, "recordDemand": False})
    (role,) = objects["ClusterRole"]
    assert role["rules"] == [rule for rule in EXPECTED_RULES if rule != DEMAND_RULE]
    (deployment,) = objects["Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == [*DEFAULT_ARGS, "--no-record-demand"]


def test_disabled_renders_no_gateway_and_rbac_off_renders_no_rules() -> None:
    assert gateway_objects(gateway={"enabled": False}) == {}
    kinds = set(gateway_objects(rbac={"create": False}))
    assert kinds == {"ServiceAccount", "Service", "PodDisruptionBudget", "Deployment"}


def container_env(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_open_by_default_with_the_fleet_key_mounted_read_only() -> None:
    objects = gateway_objects()
    (deployment,) = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container_env(deployment) == {"LLMPOOL_FLEET_KEY_FILE": f"{FLEET_KEY_DIR}/fleet-key"}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == FLEET_KEY_DIR]
    assert mount["readOnly"] is True
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes[mount["name"]]["secret"]["secretName"] == f"{RELEASE}-llmpool-fleet-key"
    # Open callers: no key and no permission on Secrets.
    assert not any(
        "secrets" in rule["resources"]
        for kind in ("Role", "ClusterRole")
        for role in objects.get(kind, [])
        for rule in role["rules"]
    )


def test_without_a_fleet_key_the_engines_are_open_and_nothing_is_mounted() -> None:
    (deployment,) = gateway_objects(fleetKey={"enabled": False})["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert "env" not in pod["containers"][0]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]


def test_one_api_key_from_a_secret() -> None:
    (deployment,) = gateway_objects(gateway={"enabled": True, "apiKeySecret": "gateway-key"})[
        "Deployment"
    ]
    assert container_env(deployment)["LLMPOOL_GATEWAY_API_KEY"] == {
        "secretKeyRef": {"name": "gateway-key", "key": "api-key"}
    }


def test_tenancy_reads_key_secrets_of_the_release_namespace_only() -> None:
    objects = gateway_objects(
        gateway={"enabled": True, "tenancy": {"enabled": True}}, watchNamespaces=["team-a"]
    )
    (deployment,) = objects["Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--api-key-namespace={NAMESPACE}" in args
    secret_roles = [
        role for role in objects["Role"] if any("secrets" in r["resources"] for r in role["rules"])
    ]
    (role,) = secret_roles
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": READ}]
    (binding,) = [
        b for b in objects["RoleBinding"] if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}
    ]
    # Cluster-wide, too, the Secrets are a Role of the release namespace, never a ClusterRole.
    clusterwide = gateway_objects(gateway={"enabled": True, "tenancy": {"enabled": True}})
    assert all("secrets" not in r["resources"] for r in clusterwide["ClusterRole"][0]["rules"])
    assert [r["metadata"]["namespace"] for r in clusterwide["Role"]] == [NAMESPACE]


def test_bounds_follow_the_values() -> None:
    (deployment,) = gateway_objects(
        gateway={"enabled": True, "maxRequests": 64, "maxBufferedBodyMiB": 32, "replicas": 3}
    )["Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-requests=64" in args and "--max-buffered-body-mib=32" in args
    assert "--replicas=3" in args  # tenant limits are per replica: the effective bound's factor


@pytest.mark.parametrize(
    "bad",
    [
        ["--set-json", 'gateway.replicas="two"'],
        ["--set", "gateway.port=9000"],
        ["--set-json", 'gateway.resources={"requests": {}, "cpu": 1}'],
        ["--set", "gateway.maxBufferedBodyMiB=8"],
        ["--set", "gateway.tenancy.on=true"],
    ],
)
def test_the_schema_rejects_bad_gateway_values(bad: list[str]) -> None:
    result = chart.helm("template", RELEASE, str(chart.CHART), *bad, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_monitoring_scrapes_the_gateway_when_on() -> None:
    for kind, value in (("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor")):
        objects = gateway_objects(monitoring={value: {"enabled": True}})
        (monitor,) = objects[kind]
        (deployment,) = objects["Deployment"]
        pods = deployment["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pods.items()
        endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        assert [(e["port"], e["path"]) for e in endpoints] == [("http", "/metrics")]
    assert "ServiceMonitor" not in gateway_objects(
        gateway={"enabled": False}, monitoring={"serviceMonitor": {"enabled": True}}
    )


def test_notes_show_the_one_base_url(tmp_path: Path) -> None:
    notes = chart.render_notes(tmp_path)
    assert f"http://llmpool-gateway.{NAMESPACE}.svc:8080/v1" in notes
    assert "llmpool-gateway" not in chart.render_notes(
        tmp_path / "off", "--set", "gateway.enabled=false"
    )
