"""Every API call of the operator (and of the gateway's demand writes) is bounded in time: against
an API server that accepts the connection and never answers, each one fails instead of hanging."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import kubernetes
import pytest
import urllib3

from llmpool.operator import kube

CALLS: dict[str, Callable[[], Awaitable[Any]]] = {
    "read_pool": lambda: kube.read_pool("team", "chat"),
    "patch_pool_status": lambda: kube.patch_pool_status("team", "chat", {"replicas": 1}),
    "patch_demand_status": lambda: kube.patch_demand_status("team", "chat", {"gateways": {}}),
    "read_metadata": lambda: kube.read_metadata("Service", "team", "chat"),
    "read_configmap_key": lambda: kube.read_configmap_key("team", "chat", "template"),
    "annotate_pod": lambda: kube.annotate_pod("team", "chat-x", {"a": "b"}),
    "delete_pod": lambda: kube.delete_pod("team", "chat-x", "uid"),
    "apply": lambda: kube.apply(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "chat", "namespace": "team"},
            "spec": {},
        }
    ),  # fmt: skip
    "ensure_peering": lambda: kube.ensure_peering("llmpool", ["team"]),
}


@pytest.fixture
def silent_api_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])  # read nothing, answer nothing
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://127.0.0.1:{listener.getsockname()[1]}"
    previous = kubernetes.client.Configuration.get_default_copy()
    kubernetes.client.Configuration.set_default(configuration)
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (1.0, 1.0))
    yield
    kubernetes.client.Configuration.set_default(previous)
    listener.close()
    for connection in accepted:
        connection.close()


@pytest.mark.parametrize("call", sorted(CALLS))
async def test_a_call_to_an_api_server_that_never_answers_times_out(silent_api_server, call):
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):
        await CALLS[call]()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("verb", ["patch", "read"])
@pytest.mark.parametrize(
    "kind", ["ConfigMap", "Secret", "Service", "PodDisruptionBudget", "Deployment", "LLMPoolDemand"]
)
def test_every_child_kind_has_its_calls(kind, verb):
    assert callable(kube._child_call(kind, verb))
