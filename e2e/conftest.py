"""Session fixtures for the e2e tests: a real control plane and node, with the project's image.

The cluster is built (or taken from the cache), started once per session and stopped at
the end; a cluster already started with ``e2e/cluster up`` is reused and left running.
When a test fails, its report gains its namespace's pods, Events and container log tails and the
tails of the logs its local processes (operator, gateway) wrote; at the end of a failed session
the daemons' and pods' logs are copied to ``e2e/.logs/<time>/`` (or ``$LLMPOOL_E2E_LOGS``) and
the tails of the daemons' logs printed.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from controlplane.cluster import Cluster  # noqa: E402
from harness import IMAGE, ClusterHandle, create_namespace  # noqa: E402

LOG_TAIL_LINES = 40
POD_LOG_TAIL_LINES = 25


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A failed test's report gains what its namespace holds, taken before its fixtures tear
    down (the operator fixtures delete the pools): CI keeps only what is printed."""
    report: pytest.TestReport = yield
    args = getattr(item, "funcargs", {})
    if report.when == "call" and report.failed and "namespace" in args and "cluster" in args:
        namespace = args["namespace"]
        text = namespace_report(args["cluster"], namespace, args.get("tmp_path"))
        report.sections.append((f"namespace {namespace}", text))
    return report


def _tail(title: str, text: str, lines: int) -> list[str]:
    tail = text.splitlines()[-lines:]
    return [f"----- {title} (last {len(tail)} lines)", *(f"  {line}" for line in tail)]


def namespace_report(cluster: ClusterHandle, namespace: str, local_logs: Path | None) -> str:
    """What a namespace holds: its pods, Events and the tails of their containers' logs, and the
    tails of the logs the test's local processes (operator, gateway) wrote to ``local_logs``."""
    kubectl = ("kubectl", "-n", namespace)
    pods = cluster.run(*kubectl, "get", "pods", "-o", "wide", check=False)
    lines = _tail("pods", pods.stdout + pods.stderr, LOG_TAIL_LINES)
    events = cluster.run(*kubectl, "get", "events", "--sort-by=.lastTimestamp", check=False)
    lines += _tail("events", events.stdout + events.stderr, LOG_TAIL_LINES)
    for pod in pods.stdout.splitlines()[1:]:
        name = pod.split()[0]
        logs = cluster.run(
            *kubectl, "logs", name, "--all-containers", f"--tail={POD_LOG_TAIL_LINES}", check=False
        )
        lines += _tail(f"pod {name}", logs.stdout + logs.stderr, POD_LOG_TAIL_LINES)
    for log in sorted(local_logs.glob("*.log")) if local_logs else []:
        lines += _tail(log.name, log.read_text(errors="replace"), LOG_TAIL_LINES)
    return "\n".join(lines)


def _report_logs(request: pytest.FixtureRequest, cluster: Cluster, why: str) -> None:
    default = Path(__file__).resolve().parent / ".logs" / time.strftime("%Y%m%d-%H%M%S")
    dest = cluster.save_logs(Path(os.environ.get("LLMPOOL_E2E_LOGS", default)))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    write(f"e2e: {why}; cluster and pod logs kept in {dest} (pods/ holds container output)")
    for log in sorted(dest.glob("*.log")):
        for line in _tail(
            str(log.relative_to(dest)), log.read_text(errors="replace"), LOG_TAIL_LINES
        ):
            write(line)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterHandle]:
    control_plane = Cluster()
    reused = control_plane.running()
    try:
        control_plane.up()
        control_plane.load(IMAGE)
    except Exception:
        _report_logs(request, control_plane, "the cluster did not start")
        raise
    # Operators started by the tests give pools the project's image, which the node has.
    env = {**os.environ, **control_plane.env(), "LLMPOOL_ENGINE_IMAGE": IMAGE}
    yield ClusterHandle(control_plane.kubeconfig, env, control_plane.logs_dir)
    if request.session.testsfailed:
        _report_logs(request, control_plane, "tests failed")
    if not reused:
        control_plane.down()


@pytest.fixture
def namespace(cluster: ClusterHandle) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    create_namespace(cluster, name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
