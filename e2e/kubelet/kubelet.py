"""The kubelet main loop: node registration, pod watch, pod workers, clean shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from controlplane import topology

from . import network, server
from .api import Api, ApiError, Json
from .container import stop_all
from .node import NodeAgent, node_status
from .pods import NodeContext, PodWorker
from .relay import Relay

log = logging.getLogger(__name__)
KUBELET_PORT = 10250


class Kubelet:
    def __init__(
        self, api: Api, node_name: str, root_dir: Path, log_dir: Path, apiserver_port: int
    ) -> None:
        self.api = api
        self.node = NodeAgent(api, node_name, KUBELET_PORT)
        allocatable = node_status(node_name, KUBELET_PORT, "")["allocatable"]
        self.ctx = NodeContext(
            api=api, node_name=node_name, host_ip=topology.POD_GATEWAY,
            allocator=network.Allocator(), root_dir=root_dir, log_dir=log_dir,
            apiserver_host=topology.POD_GATEWAY, apiserver_port=apiserver_port,
            allocatable=allocatable,
        )  # fmt: skip
        self.apiserver_port = apiserver_port
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    # ---------------------------------------------------------------- start-up
    def start(self, serving_cert: Path, serving_key: Path, client_ca: Path) -> None:
        if os.geteuid() != 0:
            raise SystemExit("the e2e kubelet needs root: it creates a network namespace per pod")
        network.remove_all()  # leftovers of a kubelet that did not shut down cleanly
        network.ensure_bridge()
        Relay(topology.POD_GATEWAY, self.apiserver_port).start()
        server.serve(
            topology.POD_GATEWAY, KUBELET_PORT, serving_cert, serving_key, client_ca, self.find_log
        )
        self.node.register()
        threading.Thread(target=self.node.run, daemon=True, name="heartbeat").start()
        threading.Thread(target=self._sync_forever, daemon=True, name="pod-sync").start()
        log.info("kubelet for node %s running", self.ctx.node_name)

    # ---------------------------------------------------------------- pods
    def _selector(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.ctx.node_name}"}

    def _sync_forever(self) -> None:
        """List, then watch, the pods bound to this node; relist when the watch ends."""
        while not self.stopping.is_set():
            try:
                listing = self.api.get("/api/v1/pods", **self._selector())
                seen = {p["metadata"]["uid"] for p in listing["items"]}
                for pod in listing["items"]:
                    self._on_pod(pod)
                with self._lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in seen]
                for worker in vanished:
                    worker.removed()
                version = listing["metadata"]["resourceVersion"]
                for event in self.api.watch("/api/v1/pods", version, **self._selector()):
                    if self.stopping.is_set():
                        return
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: relist
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        with self._lock:
                            worker = self.workers.get(obj["metadata"]["uid"])
                        if worker:
                            worker.removed()
                    else:
                        self._on_pod(obj)
            except (ApiError, OSError, ValueError) as err:
                log.warning("pod watch interrupted: %s", err)
                time.sleep(1)
            except Exception:  # noqa: BLE001 - the sync loop must survive anything
                log.exception("pod sync failed")
                time.sleep(1)

    def _on_pod(self, pod: Json) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if worker is None:
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and not pod[
                    "metadata"
                ].get("deletionTimestamp"):
                    return  # finished before this kubelet started; nothing to run
                worker = PodWorker(self.ctx, pod, self._worker_done)
                self.workers[uid] = worker
                worker.start()
                return
        worker.update(pod)

    def _worker_done(self, uid: str) -> None:
        with self._lock:
            self.workers.pop(uid, None)

    def find_log(self, namespace: str, pod: str, container: str) -> tuple[Path, bool] | None:
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            meta = worker.pod["metadata"]
            if (meta["namespace"], meta["name"]) == (namespace, pod):
                return worker.container_log(container)
        return None

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop every container (SIGTERM, a short grace, SIGKILL) and remove pod networking.

        Pod objects stay in the API, as after a real node shutdown."""
        self.stopping.set()
        self.node.stop()
        with self._lock:
            workers = list(self.workers.values())
        stop_all([c for w in workers for c in w.init + w.main], 10.0)
        network.remove_all()
