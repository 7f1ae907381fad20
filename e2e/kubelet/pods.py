"""The pod worker: one thread per pod that runs its containers and reports its status."""

from __future__ import annotations

import copy
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import envs, images, status, volumes
from .api import Api, ApiError, Json
from .container import Container, Launch, stop_all
from .network import Allocator, PodNetwork
from .node import now
from .probes import Prober

log = logging.getLogger(__name__)
TICK_SECONDS = 0.2
CONFIG_RETRY_SECONDS = 2.0


@dataclass
class NodeContext:
    """What every pod worker shares with the kubelet."""

    api: Api
    node_name: str
    host_ip: str
    allocator: Allocator
    root_dir: Path
    log_dir: Path
    apiserver_host: str
    apiserver_port: int
    allocatable: dict[str, str]

    def lookup(self, kind: str, namespace: str, name: str) -> Json | None:
        try:
            return self.api.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise


class PodWorker:
    """Sets up the pod's network and volumes, runs init then main containers, probes
    them, restarts them per restartPolicy, and terminates them gracefully on deletion."""

    def __init__(self, ctx: NodeContext, pod: Json, on_exit: Callable[[str], None]) -> None:
        self.uid: str = pod["metadata"]["uid"]
        self.name = f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']}"
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.ctx = ctx
        self._pod = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._gone = False
        self._on_exit = on_exit
        self.dir = ctx.root_dir / "pods" / self.uid
        self.net: PodNetwork | None = None
        self.volume_paths: dict[str, Path] = {}
        self.init = [Container(c) for c in pod["spec"].get("initContainers", [])]
        self.main = [Container(c) for c in pod["spec"]["containers"]]
        self.probers: dict[tuple[str, str], Prober] = {
            (c["name"], kind): Prober(c[f"{kind}Probe"], c)
            for c in pod["spec"]["containers"]
            for kind in ("startup", "liveness", "readiness")
            if c.get(f"{kind}Probe")
        }
        self.start_time = now()
        self._reported: Json | None = None
        self._conditions: list[Json] = [
            c for c in pod.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"
        ]

    # ------------------------------------------------------------ from the kubelet
    def update(self, pod: Json) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def removed(self) -> None:
        """The pod object is gone from the API (force deletion): stop at once."""
        self._gone = True
        self._wake.set()

    @property
    def pod(self) -> Json:
        with self._lock:
            return self._pod

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._prepare():
                self._loop()
        except Exception:
            log.exception("pod worker %s failed", self.name)
            stop_all(self.init + self.main, 0)
        finally:
            if self.net is not None:
                self.ctx.allocator.teardown(self.net)
            shutil.rmtree(self.dir, ignore_errors=True)
            self._on_exit(self.uid)

    def _deleting(self) -> bool:
        return self._gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    def _prepare(self) -> bool:
        """Network and volumes; waits (ContainerCreating) while referenced objects are missing."""
        if not self._deleting():
            self._report()
        if not self._deleting() and not self.pod["spec"].get("hostNetwork"):
            self.net = self.ctx.allocator.setup(self.uid)
        while not self._deleting():
            try:
                self.volume_paths = volumes.materialise(
                    self._pod_with_ips(), self.dir, self.ctx.lookup, self._token
                )
                return True
            except (envs.ConfigError, ApiError) as err:
                for c in self.init + self.main:
                    c.state = {"waiting": {"reason": "ContainerCreating", "message": str(err)}}
                self._report()
                self._wake.wait(CONFIG_RETRY_SECONDS)
                self._wake.clear()
        self._finish_deletion()
        return False

    def _loop(self) -> None:
        while True:
            if self._deleting():
                self._finish_deletion()
                return
            if self._initialized():
                for c in self.main:
                    self._step(c)
            else:
                self._step_init()
            self._report()
            self._wake.wait(TICK_SECONDS)
            self._wake.clear()

    # ------------------------------------------------------------------ containers
    @property
    def pod_ip(self) -> str:
        return self.net.ip if self.net else self.ctx.host_ip

    def _restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    def _initialized(self) -> bool:
        return all(c.terminated and c.terminated["exitCode"] == 0 for c in self.init)

    def _step_init(self) -> None:
        """Init containers run one at a time, each to success; a failed one is retried
        unless restartPolicy is Never."""
        for c in self.init:
            if c.terminated and c.terminated["exitCode"] == 0:
                continue
            if c.proc is not None:
                c.poll()
            elif c.terminated and self._restart_policy() == "Never":
                return
            elif c.terminated:
                c.schedule_restart()
            elif time.monotonic() >= c.next_start:
                self._start(c)
            return

    def _step(self, c: Container) -> None:
        if c.proc is None:
            if "waiting" in c.state and time.monotonic() >= c.next_start and not self._terminal():
                self._start(c)
            return
        if c.poll():
            self._after_exit(c)
            return
        self._probe(c)

    def _terminal(self) -> bool:
        return status.phase(self.init, self.main, self._restart_policy(), self._initialized()) in (
            "Succeeded",
            "Failed",
        )

    def _after_exit(self, c: Container) -> None:
        code = c.terminated["exitCode"] if c.terminated else 0
        policy = self._restart_policy()
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            c.schedule_restart()

    def _start(self, c: Container) -> None:
        try:
            env = envs.container_env(
                self._pod_with_ips(),
                c.spec,
                self.ctx.lookup,
                envs.host_base_env(self.pod, self.ctx.apiserver_host, self.ctx.apiserver_port),
                self.ctx.allocatable,
            )
            launch = Launch(
                argv=images.container_argv(c.spec, env),
                env=env,
                mounts=volumes.mounts(c.spec, self.volume_paths),
                working_dir=c.spec.get("workingDir"),
                namespace_prefix=self.net.exec_prefix()
                if self.net
                else ["unshare", "--mount", "--propagation", "slave"],
                log=self._log_path(c),
            )
        except (envs.ConfigError, ApiError) as err:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}
            c.next_start = time.monotonic() + CONFIG_RETRY_SECONDS
            return
        c.start(launch)
        if c.terminated:  # the command could not be started at all
            self._after_exit(c)
            return
        started = time.monotonic()
        for (name, _), prober in self.probers.items():
            if name == c.name:
                prober.reset(started)
        c.started = (c.name, "startup") not in self.probers

    def _probe(self, c: Container) -> None:
        startup = self.probers.get((c.name, "startup"))
        if startup and not c.started:
            if startup.due():
                result = startup.run(self.pod_ip, self._exec_prefix(), c.env)
                if result is True:
                    c.started = True
                elif result is False:
                    self._kill_unhealthy(c, startup)
            return
        liveness = self.probers.get((c.name, "liveness"))
        if (
            liveness
            and liveness.due()
            and liveness.run(self.pod_ip, self._exec_prefix(), c.env) is False
        ):
            self._kill_unhealthy(c, liveness)
            return
        readiness = self.probers.get((c.name, "readiness"))
        if readiness is None:
            c.ready = True
        elif readiness.due():
            c.ready = readiness.run(self.pod_ip, self._exec_prefix(), c.env) is True

    def _exec_prefix(self) -> list[str]:
        return self.net.exec_prefix() if self.net else []

    def _kill_unhealthy(self, c: Container, prober: Prober) -> None:
        log.info("%s: container %s failed its probe; killing it", self.name, c.name)
        grace = prober.spec.get("terminationGracePeriodSeconds", self._grace())
        c.stop(float(grace))
        self._after_exit(c)

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _log_path(self, c: Container) -> Path:
        meta = self.pod["metadata"]
        return self.ctx.log_dir / f"{meta['namespace']}_{meta['name']}_{self.uid}" / f"{c.name}.log"

    def container_log(self, name: str) -> tuple[Path, bool] | None:
        """The log file of container ``name`` and whether it may still grow (for `logs -f`)."""
        for c in self.init + self.main:
            if c.name == name:
                return self._log_path(c), not c.terminated and self._thread.is_alive()
        return None

    # ------------------------------------------------------------------ deletion
    def _finish_deletion(self) -> None:
        """Graceful termination, then the final status, then the pod object goes (grace 0)."""
        if self._gone:
            stop_all(self.init + self.main, 0)
            return
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds", self._grace())
        stop_all(self.init + self.main, float(grace))
        for c in self.main:
            c.ready = False
        self._report()
        try:
            self.ctx.api.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
        except ApiError as err:
            if err.status not in (404, 409):
                raise

    # ------------------------------------------------------------------ status
    def _pod_with_ips(self) -> Json:
        pod = copy.deepcopy(self.pod)
        pod.setdefault("status", {}).update(
            podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}],
            hostIP=self.ctx.host_ip, hostIPs=[{"ip": self.ctx.host_ip}],
        )  # fmt: skip
        return pod

    def _token(self, audience: str | None, expiration: int) -> str:
        meta = self.pod["metadata"]
        account = self.pod["spec"].get("serviceAccountName", "default")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": expiration,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": self.uid,
                },
            },
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        return self.ctx.api.create(path, body)["status"]["token"]

    def _status(self) -> Json:
        initialized = self._initialized()
        phase = status.phase(self.init, self.main, self._restart_policy(), initialized)
        ready = phase == "Running" and all(c.ready for c in self.main)
        self._conditions = status.conditions(
            self._conditions, self.pod, sandbox=self.net is not None or bool(self.pod["spec"].get("hostNetwork")),
            initialized=initialized, containers_ready=ready,
        )  # fmt: skip
        result: Json = {
            "phase": phase,
            "conditions": self._conditions,
            "hostIP": self.ctx.host_ip,
            "hostIPs": [{"ip": self.ctx.host_ip}],
            "startTime": self.start_time,
            "containerStatuses": [c.status() for c in self.main],
            "qosClass": self.pod.get("status", {}).get("qosClass", "BestEffort"),
        }
        if self.init:
            result["initContainerStatuses"] = [c.status() for c in self.init]
        if self.net is not None or self.pod["spec"].get("hostNetwork"):
            result.update(podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
        return result

    def _report(self) -> None:
        """Send the status when it changed (a JSON merge patch: lists are replaced whole)."""
        current = self._status()
        if current == self._reported or self._gone:
            return
        meta = self.pod["metadata"]
        try:
            self.ctx.api.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"metadata": {"uid": self.uid}, "status": current},
                kind="merge-patch",
            )
            self._reported = current
        except ApiError as err:
            if err.status == 404:
                self._gone = True
            else:
                log.warning("%s: status update failed: %s", self.name, err)
