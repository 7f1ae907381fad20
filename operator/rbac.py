"""The one list of what the operator may do in the Kubernetes API, and the manifests made from it.

The Helm chart reads both rule sets from a generated data file
(``python -m llmpool.operator.rbac --chart-data > charts/llmpool/files/operator-rbac.yaml``);
a unit test keeps that copy equal to this list. Scanning of CRDs and namespaces is disabled in the
operator (``settings.scanning.disabled``), so it needs no access to either.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from llmpool.operator import naming


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str

    def as_policy_rule(self) -> dict[str, list[str]]:
        return {
            "apiGroups": list(self.api_groups),
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }


# Needed in every namespace whose pools the operator serves.
NAMESPACED_RULES = (
    Rule(
        (naming.GROUP,),
        ("llmpools",),
        ("get", "list", "watch", "patch"),
        "watch pools; kopf keeps its finalizer and progress annotations on them",
    ),
    Rule((naming.GROUP,), ("llmpools/status",), ("patch",), "write pool status"),
    Rule(
        ("apps",),
        ("deployments",),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply of engine Deployments; watch them for status; get: is a Deployment of"
        " the pool's name the pool's own",
    ),
    Rule(
        ("",),
        ("services",),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply of the pool's Service; watch it to restore it; get: is it the pool's own",
    ),
    Rule(
        ("",),
        ("configmaps",),
        ("get", "list", "watch", "create", "patch"),
        "read the user's chat template; server-side apply of the pool's copy; watch it to restore it",
    ),
    Rule(
        ("",),
        ("secrets",),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply of the pool's engine-key Secret; watch it (label-selected) to restore"
        " it; get: is a Secret of its name the pool's own",
    ),
    Rule(
        ("policy",),
        ("poddisruptionbudgets",),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply of the pool's PodDisruptionBudget; watch it to restore it; get: is it"
        " the pool's own",
    ),
    Rule(
        (naming.GROUP,),
        (naming.DEMAND_PLURAL,),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply of the pool's LLMPoolDemand; watch the gateways' records in it",
    ),
    Rule(
        (naming.GROUP,),
        (f"{naming.DEMAND_PLURAL}/status",),
        ("patch",),
        "prune the records of gateway replicas long gone",
    ),
    Rule(
        ("",),
        ("pods",),
        ("list", "watch", "patch", "delete"),
        "watch engine pods for status and drift; keep their deletion cost in step with their"
        " load; policy Recreate deletes drifted pods",
    ),
    Rule(("",), ("events",), ("create",), "Events about pools"),
)

# Peering keeps two operator replicas from both acting; namespaced operators peer per namespace.
NAMESPACED_PEERING_RULE = Rule(
    ("kopf.dev",),
    ("kopfpeerings",),
    ("get", "list", "watch", "create", "patch"),
    "peering between operator replicas watching namespaces",
)
CLUSTER_PEERING_RULE = Rule(
    ("kopf.dev",),
    ("clusterkopfpeerings",),
    ("get", "list", "watch", "create", "patch"),
    "peering between cluster-wide operator replicas",
)


def operator_rules(*, clusterwide: bool) -> list[dict[str, list[str]]]:
    """PolicyRules of the ClusterRole (cluster-wide) or of each namespace's Role."""
    peering = CLUSTER_PEERING_RULE if clusterwide else NAMESPACED_PEERING_RULE
    return [rule.as_policy_rule() for rule in (*NAMESPACED_RULES, peering)]


def role_manifest(name: str, *, namespace: str | None) -> dict[str, Any]:
    """A ClusterRole (``namespace=None``) or a Role in ``namespace``."""
    metadata: dict[str, Any] = {"name": name, "labels": {naming.NAME_LABEL: "llmpool-operator"}}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole" if namespace is None else "Role",
        "metadata": metadata,
        "rules": operator_rules(clusterwide=namespace is None),
    }


def chart_data() -> dict[str, Any]:
    """Both rule sets, for the chart's ClusterRole and per-namespace Roles."""
    return {
        "clusterRules": operator_rules(clusterwide=True),
        "namespaceRules": operator_rules(clusterwide=False),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmpool.operator.rbac", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--name", default="llmpool-operator", help="name of the (Cluster)Role")
    parser.add_argument("--namespace", help="emit a Role in this namespace, not a ClusterRole")
    parser.add_argument(
        "--chart-data", action="store_true", help="emit both rule sets as the chart's data file"
    )
    args = parser.parse_args(argv)
    if args.chart_data:
        document = chart_data()
    else:
        document = role_manifest(args.name, namespace=args.namespace)
    sys.stdout.write(yaml.safe_dump(document, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
