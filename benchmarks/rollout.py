"""Requests failed and latency during a rollout of a 2-replica pool under load, through the gateway.

On the e2e cluster (`e2e/cluster up`), the real operator and gateway run as local processes of
the checkout whose Python runs this script (its CRD and example pool too, as a user of that
version would have them); the engine pods run ``--image``. Client threads keep requests going
through the gateway (e2e/load.py: every other one streamed, each asking for exactly
``--tokens`` tokens); after a steady phase the pool's ``maxModelLen`` changes, a pinned change
that rolls both replicas, and the phase lasts until the new replicas serve and the old ones are
gone. Per phase: requests whole and failed (non-200, cut streams, short answers), what failed,
and latency percentiles of the whole ones. Results go to ``benchmarks/results/rollout.json``
under ``--label``, beside the other labels' runs.

"Before" is the commit before zero-loss changes landed, with its own venv and image:

    e2e/cluster up
    python benchmarks/rollout.py --label after
    git worktree add /tmp/before ee2439f && cp -al .venv /tmp/before/.venv
    (cd /tmp/before && .venv/bin/pip install --no-deps -e . \\
        && IMAGE=ghcr.io/llmpool/llmpool:before bash scripts/build-image.sh)
    /tmp/before/.venv/bin/python benchmarks/rollout.py --label before \\
        --image ghcr.io/llmpool/llmpool:before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

import llmpool
from llmpool.bench.results import cpu_description, script_command
from llmpool.bench.stats import percentiles
from llmpool.operator import naming

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

from controlplane.cluster import Cluster  # noqa: E402
from harness import ClusterHandle, GatewayProcess, OperatorProcess, pod_ready, wait_for  # noqa: E402
from load import Load  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "rollout.json"
MEASURED = Path(llmpool.__file__).resolve().parents[1]  # the checkout whose code runs
POOL = "smollm2-chat"
MODEL = "smollm2"
HOLD_SECONDS = 90  # the gateway's --hold-timeout
START_SECONDS = 600


def pool_documents() -> list[dict[str, Any]]:
    """The measured version's interactive example (two replicas), made small; its own rollout
    settings as a user of that version gets them."""
    text = (MEASURED / "examples" / "smollm2-interactive.yaml").read_text()
    documents = [d for d in yaml.safe_load_all(text) if d]
    spec = next(d for d in documents if d["kind"] == naming.KIND)["spec"]
    spec["replicas"] = 2
    spec["maxModelLen"] = 256
    spec["engine"] = {
        **spec["engine"], "maxNumSeqs": 8, "maxNumBatchedTokens": 512, "kvCacheMemory": "128Mi",
    }  # fmt: skip
    spec.pop("resources", None)
    return documents


def pods(cluster: ClusterHandle, namespace: str) -> list[dict[str, Any]]:
    return cluster.get("pods", "-n", namespace, "-l", naming.selector_string(POOL))["items"]


def rolled(cluster: ClusterHandle, namespace: str, old: set[str]) -> bool:
    """Two Ready replicas, none of them old, and no old one left (drained and gone)."""
    now = pods(cluster, namespace)
    names = {p["metadata"]["name"] for p in now}
    fresh = [p for p in now if p["metadata"]["name"] not in old]
    return not names & old and len(fresh) == 2 and all(pod_ready(p) for p in fresh)


def summary(load: Load, phase: str, seconds: float) -> dict[str, Any]:
    kinds = Counter(failure.split(": ", 2)[2].split(" ", 1)[0] for failure in load.failures
                    if failure.startswith(f"{phase}: "))  # fmt: skip
    return {
        "seconds": round(seconds, 1),
        "ok": load.ok[phase],
        "failed": load.failed[phase],
        "failed_by_kind": dict(kinds),  # the status code, or how the answer fell short
        "latency_ms": {k: round(v) for k, v in percentiles(load.latencies[phase]).items()},
        "load_average_1m": os.getloadavg()[0],  # of the machine at the phase's end: 2 cores here
    }


def fresh_namespace(args: argparse.Namespace) -> tuple[ClusterHandle, str]:
    """The e2e cluster with ``--image`` loaded and the measured CRDs, and a new namespace."""
    control_plane = Cluster()
    if not control_plane.running():
        sys.exit("no e2e cluster runs: start one with e2e/cluster up")
    control_plane.load(args.image)
    env = {**os.environ, **control_plane.env(), "LLMPOOL_ENGINE_IMAGE": args.image}
    cluster = ClusterHandle(control_plane.kubeconfig, env, control_plane.logs_dir)
    namespace = f"bench-rollout-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    wait_for("the default service account", lambda: cluster.kubectl(
        "get", "serviceaccount", "default", "-n", namespace, check=False), 30)  # fmt: skip
    cluster.kubectl("apply", "-f", str(MEASURED / "crds"))
    cluster.kubectl("wait", "--for=condition=established", f"crd/{naming.PLURAL}.{naming.GROUP}")
    return cluster, namespace


def steady_then_rollout(
    cluster: ClusterHandle, namespace: str, gateway: GatewayProcess, args: argparse.Namespace
) -> tuple[dict[str, Any], Load]:
    """Load through the gateway: ``--steady-seconds`` steady, then a rollout of the pool's
    Ready replicas until new ones serve; each phase's summary, and the load."""

    def ready() -> set[str] | None:
        now = pods(cluster, namespace)
        return {p["metadata"]["name"] for p in now} if len(now) == 2 and all(
            pod_ready(p) for p in now) else None  # fmt: skip

    old = wait_for("two replicas Ready", ready, START_SECONDS, 1)
    wait_for("the gateway serving", lambda: gateway.complete("Hi", MODEL)[0] == 200, 120, 1)
    load = Load(gateway.url, MODEL, args.tokens, HOLD_SECONDS + 60)
    phases: dict[str, Any] = {}
    with ThreadPoolExecutor(args.clients) as executor:
        clients = [executor.submit(load.run, client) for client in range(args.clients)]
        try:
            began = time.monotonic()
            time.sleep(args.steady_seconds)
            phases["steady"] = summary(load, "steady", time.monotonic() - began)
            load.start("rollout")
            began = time.monotonic()
            cluster.kubectl(
                "patch", "llmpool", POOL, "-n", namespace, "--type=merge",
                "-p", json.dumps({"spec": {"maxModelLen": 512}}),
            )  # fmt: skip
            wait_for("the rollout", lambda: rolled(cluster, namespace, old), START_SECONDS, 1)
            rollout_seconds = time.monotonic() - began
        finally:
            load.stop()
            for client in clients:
                client.result()
    phases["rollout"] = summary(load, "rollout", rollout_seconds)
    return phases, load


def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster, namespace = fresh_namespace(args)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    operator = OperatorProcess(cluster, logs / "operator.log", "-n", namespace, "--standalone")
    operator.start()
    gateway = GatewayProcess(cluster, namespace, logs / "gateway.log", HOLD_SECONDS)
    try:
        cluster.apply(*pool_documents(), namespace=namespace)
        phases, load = steady_then_rollout(cluster, namespace, gateway, args)
        return {
            "label": args.label,
            "commit": subprocess.run(
                ["git", "-C", str(MEASURED), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip(),  # fmt: skip
            "image": args.image,
            "clients": args.clients,
            "tokens": args.tokens,
            "phases": phases,
            "failures": load.failures[:10],
        }
    finally:
        cluster.run("kubectl", "delete", "llmpools", "--all", "-n", namespace,
                    "--timeout=300s", check=False)  # fmt: skip
        gateway.stop()
        operator.stop()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--label", required=True, help="the run's name in the results file")
    parser.add_argument("--image", default="ghcr.io/llmpool/llmpool:0.1.0", help="engine image")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--logs", default="/tmp/llmpool-rollout-bench", help="process logs")
    args = parser.parse_args()
    result = {"command": script_command(__file__), **cpu_description(), **run(args)}
    print(json.dumps(result, indent=2))
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    recorded[args.label] = result
    RESULTS.write_text(json.dumps(recorded, indent=2) + "\n")


if __name__ == "__main__":
    main()
