"""Session fixtures for the e2e tests: a real control plane and node, with the project's image.

The cluster is built (or taken from the cache), started once per session and stopped at
the end; a cluster already started with ``e2e/cluster up`` is reused and left running.
When a test fails, the daemons' and pods' logs are copied to ``e2e/.logs/<time>/``
(or ``$LLMPOOL_E2E_LOGS``) and the tails of the daemons' logs printed.
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


def _report_logs(request: pytest.FixtureRequest, cluster: Cluster, why: str) -> None:
    default = Path(__file__).resolve().parent / ".logs" / time.strftime("%Y%m%d-%H%M%S")
    dest = cluster.save_logs(Path(os.environ.get("LLMPOOL_E2E_LOGS", default)))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    write(f"e2e: {why}; cluster and pod logs kept in {dest} (pods/ holds container output)")
    for log in sorted(dest.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        write(f"----- {log.relative_to(dest)} (last {len(lines)} lines)")
        for line in lines:
            write(f"  {line}")


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
