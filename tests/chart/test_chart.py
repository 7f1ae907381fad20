"""The Helm chart: `helm lint` and `helm template` with several value sets, asserted object by object.

Needs the helm binary: on PATH, or where the e2e build puts it
(``~/.cache/llmpool-e2e/bin/helm-*/helm``); without one these tests are skipped.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmpool.fleet_key import FLEET_KEY_FILE_ENV
from llmpool.operator import naming, rbac

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "llmpool"
RELEASE = "lp"
NAMESPACE = "llmpool-system"
E2E_CACHE = Path(os.environ.get("LLMPOOL_E2E_CACHE", Path.home() / ".cache" / "llmpool-e2e"))


def find_helm() -> str | None:
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    built = sorted((E2E_CACHE / "bin").glob("helm-*/helm"))
    return str(built[-1]) if built else None


HELM = find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="no helm binary on PATH or in ~/.cache/llmpool-e2e/bin (e2e/cluster up)"
)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    result = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def set_args(values: dict[str, Any]) -> list[str]:
    """``--set-json key=value`` for each top-level value (keeps types exact)."""
    return [
        arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")
    ]


def render(**values: Any) -> list[dict[str, Any]]:
    """`helm template` with these values, parsed (a fresh copy: tests may change it)."""
    return copy.deepcopy(_render(json.dumps(values, sort_keys=True)))


@functools.cache
def _render(values_json: str) -> list[dict[str, Any]]:
    args = set_args(json.loads(values_json))
    out = helm("template", RELEASE, str(CHART), "-n", NAMESPACE, *args).stdout
    return [document for document in yaml.safe_load_all(out) if document]


def by_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The operator's objects of a kind (the gateway's are checked in test_gateway_chart.py)."""
    return [d for d in documents if d["kind"] == kind and not is_gateway(d)]


def is_gateway(document: dict[str, Any]) -> bool:
    labels = document["metadata"].get("labels") or {}
    return labels.get("app.kubernetes.io/component") == "gateway"


def one(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(documents, kind)
    return found


VALUE_SETS = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "podMonitor": {"enabled": True},
        }
    },
    "two replicas, debug": {"replicaCount": 2, "logLevel": "debug", "extraArgs": ["--priority=7"]},
    "standalone, no dashboard": {"peering": {"enabled": False}, "dashboard": {"enabled": False}},
    "existing service account": {"serviceAccount": {"create": False, "name": "ops"}},
    "open mode, network policy": {
        "fleetKey": {"enabled": False},
        "watchNamespaces": ["team-a"],
        "networkPolicy": {"enabled": True},
    },
}


@pytest.mark.parametrize("case", VALUE_SETS)
def test_lint_is_clean(case: str) -> None:
    result = helm("lint", "--strict", str(CHART), *set_args(VALUE_SETS[case]))
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("case", VALUE_SETS)
def test_every_object_is_namespaced_to_the_release_or_a_watched_namespace(case: str) -> None:
    values = VALUE_SETS[case]
    allowed = {NAMESPACE, *values.get("watchNamespaces", [])}
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    for document in render(**values):
        metadata = document["metadata"]
        if document["kind"] in cluster_scoped:
            assert "namespace" not in metadata
            # Two releases of the same name in two namespaces must not collide.
            assert metadata["name"].endswith(f"-{NAMESPACE}")
        else:
            assert metadata.get("namespace") in allowed, (document["kind"], metadata)
        assert metadata["labels"]["app.kubernetes.io/instance"] == RELEASE


@pytest.mark.parametrize("case", VALUE_SETS)
def test_pods_run_non_root_with_a_read_only_root_filesystem(case: str) -> None:
    deployment = one(render(**VALUE_SETS[case]), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    # Writable scratch space comes from a volume, not the image.
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_the_operator_deployment_runs_llmpool_operator_under_the_charts_account() -> None:
    documents = render()
    deployment = one(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The image's ENTRYPOINT is `llmpool`; the chart gives the subcommand.
    assert "command" not in container
    assert container["image"] == "ghcr.io/llmpool/llmpool:0.1.0"
    args = container["args"]
    assert args[0] == "operator"
    assert "--all-namespaces" in args
    assert "--engine-image=ghcr.io/llmpool/llmpool:0.1.0" in args
    assert f"--peering={RELEASE}-llmpool-{NAMESPACE}" in args
    account = one(documents, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"] == f"{RELEASE}-llmpool"
    probes = {probe: container[probe]["httpGet"] for probe in ("livenessProbe", "readinessProbe")}
    assert all(get == {"path": "/healthz", "port": "healthz"} for get in probes.values())
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9090}
    assert f"--liveness-port={ports['healthz']}" in args
    assert f"--metrics-port={ports['metrics']}" in args
    # Pools may name only the chart's own image repository, and mount no node path.
    assert [a for a in args if a.startswith("--allowed-image")] == [
        "--allowed-image=ghcr.io/llmpool/llmpool"
    ]
    assert not any(a.startswith("--allow-host-path") for a in args)
    assert "--max-drift-recreations=3" in args


def test_operator_arguments_follow_the_values() -> None:
    deployment = one(
        render(
            watchNamespaces=["team-a", "team-b"],
            engineImage="registry.local/llmpool:cuda",
            logLevel="quiet",
            peering={"enabled": False},
        ),
        "Deployment",
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert [a for a in args if a.startswith("--namespace=")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert "--engine-image=registry.local/llmpool:cuda" in args
    assert "--quiet" in args and "--standalone" in args
    assert not any(a.startswith("--peering") for a in args)


def test_admission_arguments_follow_the_values() -> None:
    deployment = one(
        render(
            allowedImages=["registry.local/llmpool", "registry.local/team/"],
            allowHostPathModels=True,
            allowedHostPathPrefixes=["/models", "/data/llm"],
            maxDriftRecreations=1,
            engineGemmProbePatienceSeconds=0,
        ),
        "Deployment",
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith(("--allow", "--max-drift", "--engine-gemm"))] == [
        "--allowed-image=registry.local/llmpool",
        "--allowed-image=registry.local/team/",
        "--allow-host-path-models",
        "--allowed-host-path-prefix=/models",
        "--allowed-host-path-prefix=/data/llm",
        "--max-drift-recreations=1",
        "--engine-gemm-probe-patience=0",
    ]
    # ... and the operator accepts exactly these arguments.
    from llmpool.operator.main import build_parser, policy_from_args

    parser = build_parser()
    policy = policy_from_args(parser, parser.parse_args(args[1:]))
    assert policy.allowed_images == ("registry.local/llmpool", "registry.local/team/")
    assert policy.allowed_host_path_prefixes == ("/models", "/data/llm")
    assert policy.engine_gemm_probe_patience_s == 0.0
    default_args = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--engine-gemm-probe-patience") for a in default_args)


def test_host_path_models_without_prefixes_fail_with_a_reason() -> None:
    result = helm(
        "template", RELEASE, str(CHART), "--set", "allowHostPathModels=true", check=False
    )  # fmt: skip
    assert result.returncode != 0
    assert "allowHostPathModels needs allowedHostPathPrefixes" in result.stderr


def test_rbac_is_operator_rbac_py_clusterwide() -> None:
    documents = render()
    role = one(documents, "ClusterRole")
    assert role["rules"] == rbac.operator_rules(clusterwide=True)
    binding = one(documents, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-llmpool", "namespace": NAMESPACE}
    ]
    assert not by_kind(documents, "Role") and not by_kind(documents, "RoleBinding")


def test_rbac_is_operator_rbac_py_per_watched_namespace() -> None:
    watched = ["team-a", "team-b"]
    documents = render(watchNamespaces=watched)
    assert not by_kind(documents, "ClusterRole") and not by_kind(documents, "ClusterRoleBinding")
    roles = by_kind(documents, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == watched
    for role in roles:
        assert role["rules"] == rbac.operator_rules(clusterwide=False)
    for binding in by_kind(documents, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_rbac_off_renders_no_rules() -> None:
    documents = render(rbac={"create": False})
    kinds = {document["kind"] for document in documents}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def test_peering_objects_match_the_operator_scope() -> None:
    (cluster_peering,) = by_kind(render(), "ClusterKopfPeering")
    assert cluster_peering["metadata"]["name"] == f"{RELEASE}-llmpool-{NAMESPACE}"
    peerings = by_kind(render(watchNamespaces=["team-a", "team-b"]), "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not by_kind(render(peering={"enabled": False}), "ClusterKopfPeering")


def test_the_charts_rbac_data_file_is_generated_from_operator_rbac_py() -> None:
    data = yaml.safe_load((CHART / "files" / "operator-rbac.yaml").read_text())
    assert data == rbac.chart_data()


@pytest.mark.parametrize("name", ["llmpool.yaml", "llmpooldemand.yaml", "kopf-peering.yaml"])
def test_the_charts_crds_are_identical_to_crds(name: str) -> None:
    assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes()


def test_monitoring_is_off_by_default_and_targets_the_engines_when_on() -> None:
    assert not [d for d in render() if d["apiVersion"].startswith("monitoring.coreos.com")]
    documents = render(**VALUE_SETS["monitoring"], watchNamespaces=["team-a"])
    monitors = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ServiceMonitor"}
    engines = monitors[f"{RELEASE}-llmpool-engines"]["spec"]
    assert engines["selector"]["matchLabels"] == {naming.NAME_LABEL: naming.ENGINE_APP}
    assert engines["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert engines["endpoints"][0]["port"] == naming.ENGINE_PORT_NAME
    assert monitors[f"{RELEASE}-llmpool-operator"]["metadata"]["labels"]["release"] == "prom"
    service = one(documents, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    pod_monitors = by_kind(documents, "PodMonitor")
    assert {m["metadata"]["name"] for m in pod_monitors} == {
        f"{RELEASE}-llmpool-engines",
        f"{RELEASE}-llmpool-operator",
    }


def test_the_dashboard_configmap_carries_the_dashboard() -> None:
    configmap = next(
        d for d in render(dashboard={"namespace": "grafana"}) if d["kind"] == "ConfigMap"
    )
    assert configmap["metadata"]["namespace"] == "grafana"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "llmpool.json").read_text())
    assert json.loads(configmap["data"]["llmpool.json"]) == shipped


def test_the_dashboard_has_the_promised_panels() -> None:
    dashboard = json.loads((CHART / "dashboards" / "llmpool.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}

    def panel(word: str) -> str:
        (expr,) = [e for title, e in exprs.items() if word in title]
        return expr

    for word, metric in [
        ("TTFT", "llmpool:time_to_first_token_seconds_bucket"),
        ("TPOT", "llmpool:inter_token_latency_seconds_bucket"),
        ("Queue time", "llmpool:request_queue_time_seconds_bucket"),
    ]:
        expr = panel(word)
        assert metric in expr
        assert "histogram_quantile(0.5," in expr and "histogram_quantile(0.95," in expr
    assert "llmpool:kv_cache_usage_perc" in panel("KV-cache usage")
    assert "llmpool:num_preemptions_total" in panel("Preemptions")
    hit_rate = panel("Prefix-cache hit rate")
    assert "llmpool:prefix_cache_hits_total" in hit_rate
    assert "llmpool:prefix_cache_queries_total" in hit_rate
    assert "llmpool_operator_drifted_replicas" in panel("Drifted replicas")
    replicas = panel("Desired vs ready replicas")
    assert "llmpool_operator_desired_replicas" in replicas
    assert "llmpool_operator_ready_replicas" in replicas
    assert "llmpool_gateway:held_requests" in panel("held by the gateway")
    assert "llmpool_operator_scalings_total" in panel("Scaling events")
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def exported_families() -> set[str]:
    """The names of every metric family the operator and the gateway export, read from their
    registries (a counter's family is named without ``_total``, a histogram's without
    ``_bucket``)."""
    from prometheus_client import REGISTRY

    import llmpool.operator.metrics  # noqa: F401  (registers the operator's series)
    from llmpool.gateway.metrics import GatewayMetrics

    families = [*REGISTRY.collect(), *GatewayMetrics().series.registry.collect()]
    return {family.name for family in families}


def test_the_dashboard_reads_only_metrics_that_exist() -> None:
    """Every operator and gateway series a panel queries is one the code exports."""
    dashboard = json.loads((CHART / "dashboards" / "llmpool.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    exported = exported_families()
    queried = set(re.findall(r"(llmpool_(?:operator_|gateway:)[a-z_]+)", exprs))
    assert queried
    for name in queried:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert base in exported or name in exported, name


def render_notes(tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it (`helm template` leaves it out, and a dry-run install
    needs a cluster): a copy of the chart renders it with ``tpl`` into a ConfigMap."""
    chart = tmp_path / "llmpool"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "files/NOTES.txt") . | toJson }}}\n'
    )
    out = helm(
        "template", RELEASE, str(chart), "-n", NAMESPACE,
        "--show-only", "templates/notes-under-test.yaml", *args,
    ).stdout  # fmt: skip
    return yaml.safe_load(out)["data"]["notes"]


def test_notes_say_what_to_do_next(tmp_path: Path) -> None:
    notes = render_notes(tmp_path, "--set", "watchNamespaces={team-a}")
    assert "team-a only" in notes
    assert "kubectl apply -n team-a" in notes
    assert "kubectl get llmp" in notes
    assert "/v1/chat/completions" in notes
    assert "every namespace" in render_notes(tmp_path / "all")


def test_the_pool_in_the_notes_pins_what_the_examples_pin(tmp_path: Path) -> None:
    notes = render_notes(tmp_path)
    manifest = textwrap.dedent(notes.split("<<EOF\n", 1)[1].split("EOF", 1)[0])
    pool = yaml.safe_load(manifest)
    assert pool["kind"] == "LLMPool"
    example = yaml.safe_load((ROOT / "examples" / "smollm2-batch.yaml").read_text())
    assert pool["spec"]["model"] == {**example["spec"]["model"], "servedName": "smollm2"}


BAD_VALUES = {
    "replicaCount not an integer": ["--set-json", 'replicaCount="two"'],
    "unknown pull policy": ["--set", "image.pullPolicy=Sometimes"],
    "unknown top-level key": ["--set", "replicas=2"],
    "namespace not a DNS label": ["--set", "watchNamespaces={Team_A}"],
    "unknown log level": ["--set", "logLevel=loud"],
    "port out of range": ["--set", "ports.metrics=70000"],
    "monitor interval not a duration": ["--set", "monitoring.serviceMonitor.interval=often"],
    "relative host path prefix": ["--set", "allowedHostPathPrefixes={models}"],
    "negative drift recreations": ["--set", "maxDriftRecreations=-1"],
    "negative probe patience": ["--set", "engineGemmProbePatienceSeconds=-1"],
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_the_schema_rejects_bad_values(case: str) -> None:
    result = helm("template", RELEASE, str(CHART), *BAD_VALUES[case], check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_two_replicas_without_peering_fail_with_a_reason() -> None:
    result = helm(
        "template", RELEASE, str(CHART), "--set", "replicaCount=2", "--set", "peering.enabled=false",
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "needs peering.enabled" in result.stderr


def test_the_fleet_key_is_a_random_secret_mounted_read_only_into_the_operator() -> None:
    documents = render()
    secret = one(documents, "Secret")
    assert secret["metadata"]["name"] == f"{RELEASE}-llmpool-fleet-key"
    assert len(base64.b64decode(secret["data"]["fleet-key"])) == 64
    # Random per install (an upgrade reads the installed one back with lookup).
    again = helm("template", RELEASE, str(CHART), "-n", NAMESPACE).stdout
    assert secret["data"]["fleet-key"] not in again
    pod = one(documents, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "fleet-key")
    assert mount == {
        "name": "fleet-key",
        "mountPath": "/var/run/secrets/llmpool/fleet-key",
        "readOnly": True,
    }
    volume = next(v for v in pod["volumes"] if v["name"] == "fleet-key")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[FLEET_KEY_FILE_ENV] == "/var/run/secrets/llmpool/fleet-key/fleet-key"


def test_open_mode_has_no_fleet_key() -> None:
    documents = render(fleetKey={"enabled": False})
    assert not by_kind(documents, "Secret")
    container = one(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in container
    assert [m["name"] for m in container["volumeMounts"]] == ["tmp"]


def test_the_network_policy_admits_only_the_gateway_and_the_operator_to_engines() -> None:
    assert not by_kind(render(), "NetworkPolicy")
    documents = render(watchNamespaces=["team-a", "team-b"], networkPolicy={"enabled": True})
    policies = by_kind(documents, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    spec = policies[0]["spec"]
    assert spec["podSelector"] == {"matchLabels": {naming.NAME_LABEL: naming.ENGINE_APP}}
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": naming.ENGINE_PORT, "protocol": "TCP"}]
    components = sorted(
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"]
    )
    assert components == ["gateway", "operator"]
    for peer in rule["from"]:
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
        }
    operator = one(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= operator.items()
    failed = helm(
        "template", RELEASE, str(CHART), *set_args({"networkPolicy": {"enabled": True}}),
        check=False,
    )  # fmt: skip
    assert failed.returncode != 0 and "networkPolicy.enabled needs" in failed.stderr
