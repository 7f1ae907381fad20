"""The one reconcile path: serialized per pool, decided from the live pool, level-triggered.

The API calls of `llmpool.operator.kube` are replaced by an in-memory pool (the only way to
interleave the update handler and the timer deterministically); kopf's own Event machinery is
real, its queue read back here. The e2e suite runs the same paths against a real API server.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import time
from typing import Any

import httpx
import kopf
import pytest
from kopf._core.engines import posting
from kubernetes.client import ApiException

from llmpool.fleet_key import FleetKey, pool_engine_key
from llmpool.load import DEMAND_PRUNE_SECONDS, Demand
from llmpool.operator import admission, fingerprints, handlers, kube, observe, plan
from llmpool.operator.children import ChildView, child_view
from llmpool.operator.drift import Fingerprint
from llmpool.operator.fingerprints import FingerprintReport
from llmpool.operator.indexes import Indexed
from llmpool.operator.views import pod_view

NAMESPACE = "team"
UID = "uid-pool"


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386, as the API server applies a status merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeApi:
    """The live pool and every write the operator makes, in order."""

    def __init__(self, pool: dict[str, Any], template: str) -> None:
        self.pool = pool
        self.template = template
        self.writes: list[tuple[str, Any]] = []
        self.hold_deployment: asyncio.Event | None = None  # set: the next Deployment apply waits
        self.held = asyncio.Event()
        self.reject: dict[str, str] = {}  # kind -> the API server's message
        self.existing: dict[str, dict[str, Any]] = {}  # "Kind/name" -> metadata of others' objects
        self.demand_patches: list[dict[str, Any]] = []

    async def read_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.pool)

    async def apply(self, obj: dict[str, Any]) -> None:
        if obj["kind"] in self.reject:
            error = ApiException(status=422, reason="Unprocessable Entity")
            error.body = json.dumps({"kind": "Status", "message": self.reject[obj["kind"]]})
            raise error
        if obj["kind"] == "Deployment" and self.hold_deployment is not None:
            gate, self.hold_deployment = self.hold_deployment, None
            self.held.set()
            await gate.wait()
        self.writes.append((obj["kind"], copy.deepcopy(obj)))

    async def read_metadata(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        key = f"{kind}/{name}"
        if key in self.existing:
            return copy.deepcopy(self.existing[key])
        view = self.children().get(key)
        return copy.deepcopy(dict(view.body["metadata"])) if view is not None else None

    async def patch_demand_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.demand_patches.append(copy.deepcopy(patch))

    async def patch_pool_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        status = self.pool.setdefault("status", {})
        merge_patch(status, patch)
        self.writes.append(("status", copy.deepcopy(status)))

    async def read_configmap_key(self, namespace: str, name: str, key: str) -> str | None:
        return self.template

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self.writes.append(("Pod", {"name": name, "annotations": dict(annotations)}))

    def deployments(self) -> list[dict[str, Any]]:
        return [obj for kind, obj in self.writes if kind == "Deployment"]

    def statuses(self) -> list[dict[str, Any]]:
        return [obj for kind, obj in self.writes if kind == "status"]

    def children(self) -> dict[str, Any]:
        """The latest write of each child, as the indexes would show it."""
        latest = {}
        for kind, obj in self.writes:
            if kind not in ("status", "Pod"):
                latest[f"{kind}/{obj['metadata']['name']}"] = child_view(obj)
        return latest


@pytest.fixture
def api(chat_pool, chat_template, monkeypatch) -> FakeApi:
    pool = copy.deepcopy(chat_pool)
    pool["metadata"].update(namespace=NAMESPACE, uid=UID, generation=1)
    fake = FakeApi(pool, chat_template)
    for name in (
        "read_pool",
        "apply",
        "patch_pool_status",
        "read_configmap_key",
        "annotate_pod",
        "read_metadata",
        "patch_demand_status",
    ):
        monkeypatch.setattr(kube, name, getattr(fake, name))
    return fake


def capture_events() -> asyncio.Queue[Any]:
    """Route kopf's real posting path into a queue (context variables: this test's task only)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.WARNING
    posting.settings_var.set(settings)
    posting.event_queue_var.set(queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    return queue


def reasons(queue: asyncio.Queue[Any]) -> list[str]:
    found = []
    while not queue.empty():
        found.append(queue.get_nowait().reason)
    return found


def max_model_len(deployment: dict[str, Any]) -> str:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index("--max-model-len") + 1])


async def converge(
    api: FakeApi,
    memo: kopf.Memo,
    observed: bool = True,
    demand: dict[str, Demand] | None = None,
    claims: dict[str, list[tuple[str, str]]] | None = None,
    children: dict[str, ChildView] | None = None,
    pods: list[Any] | None = None,
) -> None:
    """One pass of the handler or the timer (they call the same function); the indexes show
    ``children`` (default: what the operator last wrote, unless not ``observed``)."""
    if children is None:
        children = api.children() if observed else {}
    await handlers.converge(
        namespace=NAMESPACE,
        name=api.pool["metadata"]["name"],
        uid=UID,
        memo=memo,
        indexes=Indexed(
            pods=pods or [],
            deployment=None,
            children=children,
            demand=demand or {},
            served_name_claims=claims or {},
        ),
    )


def update_spec(api: FakeApi, **changes: Any) -> None:
    api.pool["spec"].update(changes)
    api.pool["metadata"]["generation"] += 1


async def test_a_timer_pass_never_writes_an_older_spec_after_an_update(api):
    events = capture_events()
    memo = kopf.Memo()
    # The timer's pass starts on generation 1 and stops inside its Deployment apply ...
    api.hold_deployment = asyncio.Event()
    gate = api.hold_deployment
    timer = asyncio.create_task(converge(api, memo))
    await api.held.wait()
    # ... while the user changes the spec and the update handler's pass starts.
    update_spec(api, maxModelLen=4096)
    handler = asyncio.create_task(converge(api, memo))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(timer, handler)

    assert [max_model_len(d) for d in api.deployments()] == ["2048", "4096"]
    generations = [s["observedGeneration"] for s in api.statuses()]
    assert generations == sorted(generations) and generations[-1] == 2
    assert api.pool["status"]["pinned"]["maxModelLen"] == 4096
    assert "RolloutStarted" in reasons(events)

    # A timer whose kopf body is still generation 1 decides from the live pool: nothing to do.
    written = len(api.deployments())
    await converge(api, memo)
    assert len(api.deployments()) == written
    assert api.pool["status"]["observedGeneration"] == 2


async def test_missing_or_edited_children_are_reapplied_and_reported(api, monkeypatch):
    events = capture_events()
    monkeypatch.setattr(plan, "RESTORE_GRACE_SECONDS", 0)
    memo = kopf.Memo()
    await converge(api, memo)
    assert {kind for kind, _ in api.writes} == {
        "ConfigMap",
        "Service",
        "PodDisruptionBudget",
        "LLMPoolDemand",
        "Deployment",
        "status",
    }
    reasons(events)

    quiet = len(api.writes)
    await converge(api, memo)
    assert [kind for kind, _ in api.writes[quiet:] if kind != "status"] == []  # nothing differs
    quiet = len(api.writes)

    live = api.children()
    del live["Service/smollm2-chat"]
    del live["PodDisruptionBudget/smollm2-chat"]
    edited = copy.deepcopy(dict(live["Deployment/smollm2-chat"].body))
    edited["spec"]["template"]["spec"]["containers"][0]["args"][0] = "builtin://other"
    # Fields the API server or someone else adds do not count as a difference.
    edited["spec"]["progressDeadlineSeconds"] = 600
    edited["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    live["Deployment/smollm2-chat"] = ChildView("Deployment", "smollm2-chat", edited)
    await converge(api, memo, children=live)
    assert [kind for kind, _ in api.writes[quiet:]] == [
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    assert sorted(reasons(events)) == [
        "DeploymentRestored",
        "PodDisruptionBudgetRestored",
        "ServiceRestored",
    ]


async def test_a_rejected_child_leaves_a_condition_naming_the_problem(api):
    events = capture_events()
    api.reject["Deployment"] = (
        'spec.template.spec.containers[0].resources.requests: Invalid value: "2": '
        "must be less than or equal to cpu limit of 1"
    )
    memo = kopf.Memo()
    await converge(api, memo)
    status = api.pool["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyRejected")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyRejected")
    assert "Deployment smollm2-chat" in degraded["message"]
    assert "must be less than or equal to cpu limit" in degraded["message"]
    assert "pinnedDigest" not in status  # not reconciled
    assert reasons(events) == ["ApplyRejected"]

    # The same spec is not sent again every pass; a new spec is.
    writes = len(api.writes)
    await converge(api, memo)
    assert [kind for kind, _ in api.writes[writes:]] == []
    del api.reject["Deployment"]
    update_spec(api, resources={})
    await converge(api, memo)
    assert api.pool["status"]["observedGeneration"] == 2
    degraded = next(c for c in api.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] != "ApplyRejected"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"image": "evil.example/miner:1"}, "ImageNotAllowed"),
        (
            {"model": {"source": "file:///etc/secrets", "revision": "sha256:" + "1" * 64}},
            "HostPathNotAllowed",
        ),
        (
            # Stored before the CRD refused it: the operator says the same.
            {
                "model": {
                    "source": "builtin://smollm2-135m-instruct",
                    "revision": "sha256:" + "1" * 64,
                    "servedName": "team-a/chat",
                }
            },
            "InvalidName",
        ),
    ],
)
async def test_a_refused_pool_gets_a_condition_and_no_children(api, change, reason):
    events = capture_events()
    api.pool["spec"].update(change)
    memo = kopf.Memo(policy=admission.Policy.default("ghcr.io/llmpool/llmpool:1.0"))
    await converge(api, memo)
    assert [kind for kind, _ in api.writes] == ["status"]
    ready = next(c for c in api.pool["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason)
    assert reasons(events) == [reason]


async def test_an_autoscaled_pool_scales_from_zero_on_demand_without_a_restore_warning(
    api, monkeypatch
):
    events = capture_events()
    monkeypatch.setattr(plan, "RESTORE_GRACE_SECONDS", 0)
    loads: dict[str, float] = {}

    async def replica_loads(pods: Any) -> dict[str, float]:
        return dict(loads)

    monkeypatch.setattr(observe, "replica_loads", replica_loads)
    api.pool["spec"].pop("replicas", None)
    api.pool["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 3}
    memo = kopf.Memo()
    await converge(api, memo)
    assert [d["spec"]["replicas"] for d in api.deployments()] == [0]
    assert api.pool["status"]["autoscaling"]["desiredReplicas"] == 0
    assert api.pool["status"]["replicaSummary"] == "0/0"
    reasons(events)

    # A gateway holds two requests for the pool: the next pass scales to one at once.
    await converge(api, memo, demand={"gateway-a": Demand(held=2, at=time.time())})
    assert [d["spec"]["replicas"] for d in api.deployments()] == [0, 1]
    status = api.pool["status"]["autoscaling"]
    assert (status["desiredReplicas"], status["reason"]) == (1, "ScaledFromZero")
    assert reasons(events) == ["ScaledFromZero"]  # no DeploymentRestored for its own change

    # Turning autoscaling off hands the count back to spec.replicas and drops the state.
    api.pool["spec"].pop("autoscaling")
    update_spec(api, replicas=2)
    await converge(api, memo)
    assert api.deployments()[-1]["spec"]["replicas"] == 2
    assert "autoscaling" not in api.pool["status"]


async def test_a_scale_down_first_marks_the_idle_replica_cheapest_to_delete(
    api, monkeypatch, make_pod
):
    """Deletion costs follow the load and are written before the Deployment is scaled down."""
    capture_events()
    monkeypatch.setattr(plan, "RESTORE_GRACE_SECONDS", 0)
    loads = {"busy": 3.0, "idle": 0.0}

    async def replica_loads(pods: Any) -> dict[str, float]:
        return dict(loads)

    monkeypatch.setattr(observe, "replica_loads", replica_loads)
    memo = kopf.Memo()
    await converge(api, memo)
    name = api.pool["metadata"]["name"]
    cost = "controller.kubernetes.io/pod-deletion-cost"

    def pods(costs: dict[str, str]) -> list[Any]:
        bodies = [make_pod(p, replica_set=f"{name}-5c8d9f") for p in ("busy", "idle")]
        for body in bodies:
            if body["metadata"]["name"] in costs:
                body["metadata"]["annotations"][cost] = costs[body["metadata"]["name"]]
        return [pod_view(body) for body in bodies]

    async def converge_with(costs: dict[str, str]) -> None:
        await converge(api, memo, pods=pods(costs))

    written = len(api.writes)
    update_spec(api, replicas=1)
    await converge_with({})
    kinds = [kind for kind, _ in api.writes[written:] if kind != "status"]
    assert kinds[:2] == ["Pod", "Pod"] and "Deployment" in kinds
    costs = {obj["name"]: obj["annotations"][cost] for kind, obj in api.writes if kind == "Pod"}
    assert costs == {"busy": "3", "idle": "0"}
    assert api.deployments()[-1]["spec"]["replicas"] == 1

    # In step: nothing to write; the load changes: only that pod's cost is.
    written = len(api.writes)
    await converge_with(costs)
    loads["idle"] = 2.0
    await converge_with(costs)
    pods_written = [obj for kind, obj in api.writes[written:] if kind == "Pod"]
    assert pods_written == [{"name": "idle", "annotations": {cost: "2"}}]


@pytest.fixture
def key_file(tmp_path, monkeypatch) -> Any:
    """A fleet key file (the operator re-reads it every pass); no restore grace."""
    monkeypatch.setattr(plan, "RESTORE_GRACE_SECONDS", 0)
    path = tmp_path / "fleet-key"
    path.write_text("fleet")
    return path


async def test_a_keyed_pool_gets_its_secret_before_its_deployment(api, key_file):
    events = capture_events()
    memo = kopf.Memo(fleet_key=FleetKey(key_file))
    await converge(api, memo)
    kinds = [kind for kind, _ in api.writes if kind != "status"]
    assert kinds.index("Secret") < kinds.index("Deployment")
    (secret,) = [obj for kind, obj in api.writes if kind == "Secret"]
    key = pool_engine_key(b"fleet", NAMESPACE, "smollm2-chat")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == key
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    assert key not in json.dumps(api.deployments()) + json.dumps(api.pool["status"])
    assert all(key not in event.message for event in drain(events))

    # Edited by hand: restored, and the Event names the field, never the key.
    live = api.children()
    edited = copy.deepcopy(dict(live["Secret/smollm2-chat-engine-key"].body))
    edited["data"]["api-key"] = base64.b64encode(b"guessed").decode()
    live["Secret/smollm2-chat-engine-key"] = ChildView("Secret", "smollm2-chat-engine-key", edited)
    written = len(api.writes)
    await converge(api, memo, children=live)
    assert [kind for kind, _ in api.writes[written:] if kind != "status"] == ["Secret"]
    (restored,) = drain(events)
    assert restored.reason == "SecretRestored" and ".data.api-key" in restored.message
    assert key not in restored.message


async def test_an_object_of_a_childs_name_that_is_not_the_pools_blocks_every_child(api):
    events = capture_events()
    api.existing["Service/smollm2-chat"] = {"name": "smollm2-chat", "labels": {"team": "web"}}
    memo = kopf.Memo()
    await converge(api, memo)
    assert [kind for kind, _ in api.writes] == ["status"]  # nothing applied, nothing half-applied
    degraded = next(c for c in api.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "OwnershipConflict")
    assert "Service smollm2-chat already exists" in degraded["message"]
    assert degraded["observedGeneration"] == 1
    assert reasons(events) == ["OwnershipConflict"]

    # Checked again every pass, without a new Event; once the object is gone, the pool converges.
    await converge(api, memo)
    assert [kind for kind, _ in api.writes].count("Service") == 0
    assert reasons(events) == []
    del api.existing["Service/smollm2-chat"]
    await converge(api, memo)
    assert "Service" in [kind for kind, _ in api.writes]
    degraded = next(c for c in api.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"


async def test_a_served_name_claimed_in_another_namespace_is_reported_on_the_pool(api):
    events = capture_events()
    memo = kopf.Memo()
    claims = {"smollm2": [(NAMESPACE, "smollm2-chat"), ("other-team", "theirs")]}
    await converge(api, memo, claims=claims)
    conflict = next(
        c for c in api.pool["status"]["conditions"] if c["type"] == "ServedNameConflict"
    )
    assert (conflict["status"], conflict["reason"]) == ("True", "ClaimedInOtherNamespaces")
    assert "other-team/theirs" in conflict["message"]
    assert "ClaimedInOtherNamespaces" in reasons(events)
    await converge(api, memo, claims={"smollm2": [(NAMESPACE, "smollm2-chat")]})
    assert reasons(events) == ["Unique"]


async def test_records_of_gateways_long_gone_are_pruned(api):
    capture_events()
    now = time.time()
    demand = {
        "alive": Demand(held=1, at=now),
        "gone": Demand(held=3, at=now - DEMAND_PRUNE_SECONDS - 1),
    }
    await converge(api, kopf.Memo(), demand=demand)
    assert api.demand_patches == [{"gateways": {"gone": None}}]


def drain(queue: asyncio.Queue[Any]) -> list[Any]:
    found = []
    while not queue.empty():
        found.append(queue.get_nowait())
    return found


async def test_a_rotated_fleet_key_rolls_the_engines_with_one_normal_event(api, key_file, tmp_path):
    events = capture_events()
    memo = kopf.Memo(fleet_key=FleetKey(key_file))
    await converge(api, memo)
    drain(events)
    rotated = tmp_path / "rotated"
    rotated.write_text("rotated")
    rotated.replace(key_file)  # as the kubelet swaps a Secret volume's files
    written = len(api.writes)
    await converge(api, memo)
    assert [kind for kind, _ in api.writes[written:] if kind != "status"] == [
        "Secret",
        "Deployment",
    ]
    assert [event.reason for event in drain(events)] == ["EngineKeyRotated"]
    written = len(api.writes)
    await converge(api, memo)
    assert [kind for kind, _ in api.writes[written:] if kind != "status"] == []


class FakeEngines:
    """Engine pods as the operator reaches them: GET /fingerprint and the adapter endpoints.

    ``files`` is what lies on the node at each adapter path (the digest of its files); a load
    whose revision does not match is refused and remembered, as the engine does."""

    def __init__(self, digest: str, files: dict[str, str]) -> None:
        self.digest = digest
        self.files = files
        self.served: dict[str, dict[str, str]] = {}
        self.failures: dict[str, dict[str, dict[str, Any]]] = {}
        self.posts: list[tuple[str, str, dict[str, Any], str | None]] = []

    def body(self, pod: str) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "observed": {},
            "lora": {"maxLoras": 4, "maxLoraRank": 16},
            "adapters": [
                {"name": name, "digest": digest}
                for name, digest in self.served.get(pod, {}).items()
            ],
            "adapterFailures": list(self.failures.get(pod, {}).values()),
        }

    async def fetch_fingerprints(self, pods: Any, **_: Any) -> Any:
        found = [Fingerprint(p.name, p.digest, self.body(p.name)) for p in pods if p.ready]
        return FingerprintReport(found)

    async def post_to_pod(
        self, pod: Any, path: str, body: dict[str, Any], engine_key: str | None, **_: Any
    ) -> httpx.Response:
        self.posts.append((pod.name, path, dict(body), engine_key))
        served = self.served.setdefault(pod.name, {})
        failures = self.failures.setdefault(pod.name, {})
        name = body["lora_name"]
        if path == "/v1/unload_lora_adapter":
            served.pop(name)
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed.")
        digest = self.files[body["lora_path"]]
        if digest != body["revision"]:
            failures[name] = {
                "name": name,
                "source": body["lora_path"],
                "revision": body["revision"],
                "digest": digest,
                "code": "revision_mismatch",
                "error": f"the files are {digest}",
            }
            error = {"code": "revision_mismatch", "message": f"the files are {digest}"}
            return httpx.Response(400, json={"error": error})
        served[name] = digest
        failures.pop(name, None)
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")


REV = {name: "sha256:" + digit * 64 for name, digit in (("a", "a"), ("b", "b"), ("c", "c"))}
TAMPERED = "sha256:" + "f" * 64


def adapter_spec(name: str) -> dict[str, str]:
    return {"name": name, "source": f"file:///var/lib/adapters/{name}", "revision": REV[name]}


class AdapterPool:
    """A pool with adapters `a` and `b` on two running replicas (FakeEngines), reconciled once;
    ``converge`` runs a pass with the replicas in the indexes (``p2`` restarted ``restarts``
    times), ``offset`` moves the operator's clock."""

    def __init__(self, api: FakeApi, memo: kopf.Memo, make_pod: Any) -> None:
        self.api, self.memo, self.make_pod = api, memo, make_pod
        self.name = api.pool["metadata"]["name"]
        self.template = api.deployments()[-1]["spec"]["template"]
        self.roots = self.template["metadata"]["annotations"]["llmpool.dev/adapter-roots"]
        self.digest = api.pool["status"]["pinnedDigest"]
        self.engines = FakeEngines(self.digest, {f"/var/lib/adapters/{n}": REV[n] for n in REV})
        self.offset = [0.0]

    def pods(self, restarts: int) -> list[Any]:
        replica_set = f"{self.name}-5c8d9f"
        bodies = [
            self.make_pod("p1", digest=self.digest, replica_set=replica_set),
            self.make_pod(
                "p2", digest=self.digest, replica_set=replica_set, restart_count=restarts
            ),
        ]
        for body in bodies:
            body["metadata"]["annotations"]["llmpool.dev/adapter-roots"] = self.roots
        return [pod_view(body) for body in bodies]

    async def converge(self, restarts: int = 0) -> None:
        await converge(self.api, self.memo, pods=self.pods(restarts))

    def condition(self, kind: str) -> tuple[str, str]:
        found = next(c for c in self.api.pool["status"]["conditions"] if c["type"] == kind)
        return found["status"], found["reason"]

    def serving(self) -> dict[str, list[str]]:
        return {a["name"]: a["replicas"] for a in self.api.pool["status"].get("adapters", [])}


@pytest.fixture
async def adapter_pool(api, tmp_path, monkeypatch, make_pod) -> AdapterPool:
    capture_events()  # the tests capture their own
    monkeypatch.setattr(plan, "RESTORE_GRACE_SECONDS", 0)

    async def replica_loads(pods: Any) -> dict[str, float]:
        return {}

    monkeypatch.setattr(observe, "replica_loads", replica_loads)
    key_file = tmp_path / "fleet-key"
    key_file.write_text("fleet")
    policy = admission.Policy(
        engine_image="llmpool:latest",
        allowed_images=("llmpool",),
        allow_host_path_models=True,
        allowed_host_path_prefixes=("/var/lib/adapters",),
    )
    memo = kopf.Memo(fleet_key=FleetKey(key_file), policy=policy)
    api.pool["spec"]["adapters"] = [adapter_spec("a"), adapter_spec("b")]
    api.pool["spec"]["drift"] = {"policy": "Report", "intervalSeconds": 30}
    await converge(api, memo)
    pool = AdapterPool(api, memo, make_pod)
    real_monotonic = time.monotonic
    monkeypatch.setattr(observe.time, "monotonic", lambda: real_monotonic() + pool.offset[0])
    monkeypatch.setattr(fingerprints, "fetch_fingerprints", pool.engines.fetch_fingerprints)
    monkeypatch.setattr(fingerprints, "post_to_pod", pool.engines.post_to_pod)
    return pool


async def test_adapters_are_loaded_on_running_replicas(adapter_pool, api):
    events = capture_events()
    pool, engines = adapter_pool, adapter_pool.engines
    assert json.loads(pool.roots) == ["/var/lib/adapters"]
    # The first check loads both adapters on both replicas, with the pool's engine key.
    await pool.converge()
    assert sorted((pod, body["lora_name"]) for pod, _, body, _ in engines.posts) == [
        ("p1", "a"), ("p1", "b"), ("p2", "a"), ("p2", "b"),
    ]  # fmt: skip
    assert {key for *_, key in engines.posts} == {pool_engine_key(b"fleet", NAMESPACE, pool.name)}
    assert engines.posts[0][2]["lora_path"].startswith("/var/lib/adapters/")
    assert pool.serving() == {"a": ["p1", "p2"], "b": ["p1", "p2"]}
    assert pool.condition("Drifted") == ("False", "NoDrift")
    assert [(e.reason, e.message) for e in drain(events) if "Adapter" in e.reason] == [
        ("AdapterLoaded", f"adapter a loaded at {REV['a']} on p1, p2"),
        ("AdapterLoaded", f"adapter b loaded at {REV['b']} on p1, p2"),
    ]
    # All went well: the next pass checks again at once, finds nothing to do.
    posted = len(engines.posts)
    await pool.converge()
    assert len(engines.posts) == posted

    # A third adapter under the mounted folder: loaded on the running pods, template unchanged.
    update_spec(api, adapters=[adapter_spec("a"), adapter_spec("b"), adapter_spec("c")])
    await pool.converge()
    await pool.converge()
    assert api.deployments()[-1]["spec"]["template"] == pool.template
    assert sorted((pod, body["lora_name"]) for pod, _, body, _ in engines.posts[posted:]) == [
        ("p1", "c"), ("p2", "c"),
    ]  # fmt: skip
    assert pool.serving()["c"] == ["p1", "p2"]


async def test_a_refused_adapter_is_drift_retried_once_per_interval_and_unloaded(adapter_pool, api):
    events = capture_events()
    pool, engines = adapter_pool, adapter_pool.engines
    update_spec(api, adapters=[adapter_spec("a"), adapter_spec("b"), adapter_spec("c")])
    await pool.converge()
    await pool.converge()
    drain(events)

    # Tampered: the files of `a` change on p2's node and p2 restarts. Its load is refused.
    engines.files["/var/lib/adapters/a"] = TAMPERED
    engines.served["p2"] = {}
    await pool.converge(restarts=1)
    assert api.pool["status"]["drift"] == [
        {"pod": "p2", "field": "adapters.a", "expected": REV["a"], "actual": TAMPERED}
    ]
    assert pool.condition("Drifted") == ("True", "ReplicasDrifted")
    assert pool.serving() == {"a": ["p1"], "b": ["p1", "p2"], "c": ["p1", "p2"]}
    reported = {(e.type, e.reason): e.message for e in drain(events)}
    assert reported[("Warning", "DriftDetected")] == (
        f"pod p2: adapters.a is {TAMPERED}, expected {REV['a']}"
    )
    assert "revision_mismatch" in reported[("Warning", "AdapterLoadFailed")]
    # Not retried on every pass ...
    posted = len(engines.posts)
    await pool.converge(restarts=1)
    assert len(engines.posts) == posted
    # ... but once per drift interval: the files restored, the drift clears.
    engines.files["/var/lib/adapters/a"] = REV["a"]
    pool.offset[0] += 31
    await pool.converge(restarts=1)
    assert [(pod, body["lora_name"]) for pod, _, body, _ in engines.posts[posted:]] == [("p2", "a")]
    assert api.pool["status"]["drift"] == []
    assert pool.condition("Drifted") == ("False", "NoDrift")
    assert pool.serving()["a"] == ["p1", "p2"]
    drain(events)

    # Removed from the spec: unloaded from every replica, gone from status.adapters.
    update_spec(api, adapters=[adapter_spec("b"), adapter_spec("c")])
    await pool.converge(restarts=1)
    await pool.converge(restarts=1)
    assert engines.served == {
        "p1": {"b": REV["b"], "c": REV["c"]},
        "p2": {"b": REV["b"], "c": REV["c"]},
    }
    assert pool.serving() == {"b": ["p1", "p2"], "c": ["p1", "p2"]}
    assert [(e.reason, e.message) for e in drain(events) if "Adapter" in e.reason] == [
        ("AdapterUnloaded", "adapter a unloaded from p1, p2")
    ]
    assert api.deployments()[-1]["spec"]["template"] == pool.template
