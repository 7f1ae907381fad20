"""The e2e cluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and one
node (containerd, the kubelet, kube-proxy; CoreDNS as an add-on), all on one machine, state in
one directory.

``Cluster.up`` is idempotent: a cluster whose daemons are all alive is reused as is.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import addons, build, certs, images, network, node, processes, runtime, topology, versions
from .locking import locked

E2E_DIR = Path(__file__).resolve().parent.parent
# Stop order matters (the reverse): the node goes first, while the apiserver is still up, and
# containerd after the kubelet, so that the pods can be removed through it.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-proxy",
)
LOCK_NAME = ".lock"


def default_state_dir() -> Path:
    return Path(os.environ.get("LLMPOOL_E2E_STATE", E2E_DIR / ".state"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log(msg: str) -> None:
    print(f"[e2e cluster] {msg}", file=sys.stderr, flush=True)


@dataclass
class Record:
    """What ``up`` wrote down about a running cluster (``cluster.json``)."""

    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    version: str = versions.KUBERNETES

    @classmethod
    def load(cls, path: Path) -> Record | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__, indent=2) + "\n")


class Cluster:
    """A control plane plus kubelet whose state lives under ``state_dir``."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = (state_dir or default_state_dir()).resolve()
        self.pki = certs.Pki(self.state_dir / "pki")
        self.logs_dir = self.state_dir / "logs"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.containerd_socket = self.state_dir / "containerd.sock"
        self._record_path = self.state_dir / "cluster.json"

    # ----------------------------------------------------------------- queries
    def record(self) -> Record | None:
        return Record.load(self._record_path)

    def component_status(self) -> dict[str, bool]:
        rec = self.record()
        pids = rec.pids if rec else {}
        return {c: c in pids and processes.alive(pids[c]) for c in COMPONENTS}

    def node_runtime(self) -> runtime.Clients:
        """ctr and crictl against this cluster's containerd."""
        return runtime.Clients(self.containerd_socket, build.crictl_path())

    def running(self) -> bool:
        status = self.component_status()
        return all(status.values()) and self._apiserver_ready()

    @property
    def server(self) -> str:
        rec = self.record()
        if rec is None:
            raise RuntimeError(f"no cluster recorded under {self.state_dir}")
        return f"https://127.0.0.1:{rec.ports['apiserver']}"

    def env(self) -> dict[str, str]:
        """Environment for kubectl and helm against this cluster."""
        dirs = [str(d) for d in build.bin_dirs()]
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": os.pathsep.join([*dirs, os.environ.get("PATH", "")]),
        }

    # -------------------------------------------------------------------- up
    def up(self, timeout: float = 180.0) -> None:
        """Start the cluster, or reuse it if it runs; concurrent callers wait for each other."""
        binaries = build.ensure_binaries()
        with locked(self.state_dir / LOCK_NAME):
            if self.running():
                _log(f"reusing the running cluster in {self.state_dir}")
                return
            self._stop(quiet=True)
            self._start(binaries, timeout)

    def _start(self, binaries: build.Binaries, timeout: float) -> None:
        started = time.monotonic()
        shutil.rmtree(self.logs_dir, ignore_errors=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ports = ["etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler"]
        ports += ["kubelet", "kube-proxy-healthz", "kube-proxy-metrics"]
        rec = Record(ports={name: _free_port() for name in ports})
        self._make_credentials(rec)
        _log(f"credentials ready ({time.monotonic() - started:.1f}s)")
        deadline = time.monotonic() + timeout
        network.prepare_host()
        rec.pids["etcd"] = self._spawn("etcd", self._etcd_argv(binaries, rec))
        rec.save(self._record_path)
        self._wait(
            "etcd", lambda: self._http_ok(f"http://127.0.0.1:{rec.ports['etcd']}/health"), deadline
        )
        rec.pids["kube-apiserver"] = self._spawn(
            "kube-apiserver", self._apiserver_argv(binaries, rec)
        )
        rec.save(self._record_path)
        self._wait("kube-apiserver", self._apiserver_ready, deadline)
        rec.pids["kube-controller-manager"] = self._spawn(
            "kube-controller-manager", self._controller_manager_argv(binaries, rec)
        )
        rec.pids["kube-scheduler"] = self._spawn(
            "kube-scheduler", self._scheduler_argv(binaries, rec)
        )
        self._start_node(binaries, rec, deadline)
        rec.save(self._record_path)
        for name, port in (
            ("kube-controller-manager", rec.ports["controller-manager"]),
            ("kube-scheduler", rec.ports["scheduler"]),
        ):
            self._wait(
                name, lambda p=port: self._http_ok(f"https://127.0.0.1:{p}/healthz"), deadline
            )
        self._wait("node Ready", self._node_ready, deadline)
        self._apply(addons.coredns(runtime.COREDNS_IMAGE))
        self._wait("CoreDNS", self._dns_ready, deadline)
        self._wait(
            "default service account",
            lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"),
            deadline,
        )
        self._wait(
            "kube-root-ca.crt",
            lambda: self._api_ok("/api/v1/namespaces/default/configmaps/kube-root-ca.crt"),
            deadline,
        )
        _log(f"cluster up in {time.monotonic() - started:.1f}s; KUBECONFIG={self.kubeconfig}")

    def _make_credentials(self, rec: Record) -> None:
        pki = self.pki
        certs.create_ca(pki)
        certs.create_service_account_keys(pki)
        certs.issue(
            pki, "apiserver", "kube-apiserver", server=True, dns=certs.APISERVER_DNS,
            ips=("127.0.0.1", topology.POD_GATEWAY, topology.KUBERNETES_SERVICE_IP),
        )  # fmt: skip
        certs.issue(
            pki,
            "kubelet-serving",
            topology.NODE_NAME,
            server=True,
            ips=(topology.POD_GATEWAY, "127.0.0.1"),
        )
        certs.issue(
            pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"
        )
        server = f"https://127.0.0.1:{rec.ports['apiserver']}"
        clients = {
            "admin": ("kubernetes-admin", "system:masters"),
            "controller-manager": ("system:kube-controller-manager", None),
            "scheduler": ("system:kube-scheduler", None),
            "kubelet": (f"system:node:{topology.NODE_NAME}", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", None),
        }
        for name, (cn, org) in clients.items():
            certs.issue(pki, name, cn, org)
            path = self.kubeconfig if name == "admin" else self.state_dir / f"{name}.kubeconfig"
            certs.write_kubeconfig(path, server, pki, cn, name)

    def _spawn(self, name: str, argv: list[str], cwd: Path | None = None) -> int:
        pid = processes.spawn(argv, self.logs_dir / f"{name}.log", cwd=cwd)
        _log(f"started {name} (pid {pid})")
        return pid

    def _etcd_argv(self, b: build.Binaries, rec: Record) -> list[str]:
        client = f"http://127.0.0.1:{rec.ports['etcd']}"
        peer = f"http://127.0.0.1:{rec.ports['etcd-peer']}"
        return [
            str(b.etcd),
            "--name=e2e",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e2e={peer}",
            "--unsafe-no-fsync",  # a throwaway test store; fsync only costs time
            "--log-level=warn",
        ]

    def _apiserver_argv(self, b: build.Binaries, rec: Record) -> list[str]:
        pki = self.pki
        return [
            str(b.kube_apiserver),
            # Pods reach the apiserver at the bridge's address, the node's: listen there too.
            "--bind-address=0.0.0.0",
            f"--secure-port={rec.ports['apiserver']}",
            # What the `kubernetes` Service endpoints say: the pod network gateway.
            f"--advertise-address={topology.POD_GATEWAY}",
            f"--etcd-servers=http://127.0.0.1:{rec.ports['etcd']}",
            f"--service-cluster-ip-range={topology.SERVICE_CIDR}",
            f"--client-ca-file={pki.ca_crt}",
            f"--tls-cert-file={pki.crt('apiserver')}",
            f"--tls-private-key-file={pki.key('apiserver')}",
            f"--kubelet-client-certificate={pki.crt('apiserver-kubelet-client')}",
            f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
            f"--kubelet-certificate-authority={pki.ca_crt}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--profiling=false",
        ]

    def _component_argv(self, binary: Path, name: str, port: int) -> list[str]:
        kubeconfig = self.state_dir / f"{name}.kubeconfig"
        return [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--leader-elect=false",
        ]

    def _controller_manager_argv(self, b: build.Binaries, rec: Record) -> list[str]:
        return [
            *self._component_argv(
                b.kube_controller_manager, "controller-manager", rec.ports["controller-manager"]
            ),
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--root-ca-file={self.pki.ca_crt}",
            "--use-service-account-credentials=true",
            f"--cluster-cidr={topology.POD_CIDR}",
            f"--service-cluster-ip-range={topology.SERVICE_CIDR}",
        ]

    def _scheduler_argv(self, b: build.Binaries, rec: Record) -> list[str]:
        return self._component_argv(b.kube_scheduler, "scheduler", rec.ports["scheduler"])

    def _start_node(self, b: build.Binaries, rec: Record, deadline: float) -> None:
        """containerd (with the pause and CoreDNS images), the kubelet and kube-proxy."""
        state = self.state_dir
        network.write_cni_config(state / "cni" / "net.d", state / "cni" / "ipam")
        config = state / "containerd.toml"
        config.write_text(runtime.config(state, self.containerd_socket))
        containerd = [runtime.containerd_binary(), f"--config={config}"]
        rec.pids["containerd"] = self._spawn("containerd", containerd)
        rec.save(self._record_path)
        clients = self.node_runtime()
        self._wait("containerd", clients.ready, deadline)
        self._load_node_images(b, clients)
        kubelet_config = node.write_yaml(
            state / "kubelet-config.yaml",
            node.kubelet_config(
                self.pki, self.containerd_socket, rec.ports["kubelet"], self.logs_dir / "pods"
            ),
        )
        rec.pids["kubelet"] = self._spawn(
            "kubelet",
            node.kubelet_argv(
                b.kubelet, kubelet_config, state / "kubelet.kubeconfig", state / "kubelet"
            ),
        )
        proxy_config = node.write_yaml(
            state / "kube-proxy-config.yaml",
            node.kube_proxy_config(
                state / "kube-proxy.kubeconfig",
                rec.ports["kube-proxy-healthz"],
                rec.ports["kube-proxy-metrics"],
            ),
        )
        rec.pids["kube-proxy"] = self._spawn(
            "kube-proxy", node.kube_proxy_argv(b.kube_proxy, proxy_config)
        )

    def _load_node_images(self, b: build.Binaries, clients: runtime.Clients) -> None:
        """Import the pause and CoreDNS images, made here from their binaries, when missing."""
        present = clients.images()
        for image in (
            images.ScratchImage(runtime.PAUSE_IMAGE, b.pause, "/pause"),
            images.ScratchImage(
                runtime.COREDNS_IMAGE, b.coredns, "/coredns", user="0:0", exposed=("53/udp",)
            ),
        ):
            if image.name not in present:
                archive = images.write_oci_archive(image, self.state_dir / "images" / "image.tar")
                clients.import_archive(archive)
                archive.unlink()
                _log(f"imported {image.name}")

    def load(self, image: str) -> None:
        """Import ``image`` from Docker into the node, unless the node has that very image."""
        if not self.node_runtime().ready():
            raise RuntimeError("`load` needs a running cluster: run `e2e/cluster up` first")
        clients = self.node_runtime()
        docker_id = images.docker_image_id(image)
        if clients.image_config_digest(image) == docker_id:
            _log(f"{image} is loaded already ({docker_id})")
            return
        started = time.monotonic()
        clients.import_from_docker(image)
        _log(f"loaded {image} into the node in {time.monotonic() - started:.0f}s")

    def _apply(self, manifests: list[dict[str, object]]) -> None:
        proc = subprocess.run(
            ["kubectl", "apply", "-f", "-"],
            input=yaml.safe_dump_all(manifests),
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl apply of the add-ons failed: {proc.stderr.strip()}")

    def _dns_ready(self) -> bool:
        path = f"/apis/apps/v1/namespaces/{addons.NAMESPACE}/deployments/coredns"
        status = (self.api_get(path) or {}).get("status", {})
        return bool(status.get("readyReplicas"))

    # ------------------------------------------------------------- readiness
    def _wait(self, what: str, ready: Callable[[], bool], deadline: float) -> None:
        started = time.monotonic()
        while not ready():
            rec = self.record()
            dead = [
                name for name, pid in (rec.pids if rec else {}).items() if not processes.alive(pid)
            ]
            if dead:
                raise RuntimeError(
                    f"waiting for {what}: {', '.join(dead)} exited; see {self.logs_dir}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; see {self.logs_dir}")
            time.sleep(0.25)
        _log(f"{what} ready ({time.monotonic() - started:.1f}s)")

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
        ctx.load_cert_chain(str(self.pki.crt("admin")), str(self.pki.key("admin")))
        return ctx

    def _http_ok(self, url: str) -> bool:
        ctx = None
        if url.startswith("https"):
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def api_get(self, path: str) -> dict | None:
        """GET ``path`` from the apiserver as admin; None when it does not answer 200."""
        rec = self.record()
        if rec is None or not self.pki.ca_crt.exists():
            return None
        url = f"https://127.0.0.1:{rec.ports['apiserver']}{path}"
        try:
            with urllib.request.urlopen(url, timeout=3, context=self._ssl_context()) as resp:
                body = resp.read()
        except (OSError, urllib.error.URLError):
            return None
        try:
            return json.loads(body)
        except ValueError:
            return {"text": body.decode(errors="replace")}

    def _api_ok(self, path: str) -> bool:
        return self.api_get(path) is not None

    def _apiserver_ready(self) -> bool:
        return self._api_ok("/readyz")

    def _node_ready(self) -> bool:
        node = self.api_get(f"/api/v1/nodes/{topology.NODE_NAME}") or {}
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # ------------------------------------------------------------------ down
    def down(self) -> None:
        """Stop every daemon (kubelet first, etcd last) and remove the state, logs excepted."""
        with locked(self.state_dir / LOCK_NAME):
            self._stop(quiet=False)

    def _stop(self, quiet: bool) -> None:
        rec = self.record()
        if rec is not None:
            for name in reversed(COMPONENTS):
                if name not in rec.pids:
                    continue
                if name == "containerd" and processes.alive(rec.pids[name]):
                    self.node_runtime().remove_pods()  # sandboxes, containers and their networks
                processes.stop(rec.pids[name], grace=10.0)
                if not quiet:
                    _log(f"stopped {name}")
            self._cleanup_proxy_rules()
        network.remove()
        processes.unmount_under(self.state_dir)  # pod volumes, which the kubelet leaves mounted
        for entry in self.state_dir.glob("*") if self.state_dir.exists() else []:
            if entry not in (self.logs_dir, self.state_dir / LOCK_NAME):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def _cleanup_proxy_rules(self) -> None:
        """kube-proxy's own clean-up of the iptables chains it made."""
        proxy = build.kube_proxy_path()
        if proxy.exists():
            subprocess.run([str(proxy), "--cleanup"], capture_output=True, check=False)

    def save_logs(self, dest: Path) -> Path:
        """Copy the daemons' and pods' logs to ``dest`` (kept when a test run fails)."""
        dest.mkdir(parents=True, exist_ok=True)
        if self.logs_dir.exists():
            shutil.copytree(self.logs_dir, dest, dirs_exist_ok=True)
        return dest
