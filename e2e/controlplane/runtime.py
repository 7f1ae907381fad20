"""containerd, the node's container runtime: its configuration, the CRI and ctr clients, and
image loading.

The e2e containerd is its own instance (socket in the state directory), so it never meets a
containerd that Docker or the system runs. Its root, which holds the images, lives in the
build cache and outlives ``e2e/cluster down`` (unlike a kind node's), so a warm ``up`` does not
import the several-GB project image again. Everything else (its state, pods, sandboxes) goes
with the cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from . import network, versions

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
PAUSE_IMAGE = f"localhost/e2e/pause:{versions.PAUSE_TAG}"
COREDNS_IMAGE = f"localhost/e2e/coredns:{versions.COREDNS}"


class ContainerRuntimeError(RuntimeError):
    """containerd or one of its clients failed."""


def _retry_vanished_snapshot(attempt: Callable[[], None]) -> None:
    """Run an image import, once more if a snapshot vanished under it.

    The root outlives clusters, so an earlier build of the image can leave unreferenced layer
    snapshots behind. containerd's garbage collector may remove one after the unpacker found it
    (and skipped that layer) but before the next layer is prepared on it: "parent snapshot ...
    does not exist". Seen on a CI run after an image rebuild; the second import unpacked the
    layer afresh and succeeded.
    """
    try:
        attempt()
    except ContainerRuntimeError as error:
        if "does not exist" not in str(error):
            raise
        attempt()


def root_dir() -> Path:
    return versions.cache_dir() / "containerd"


def config(state_dir: Path, socket: Path) -> str:
    """containerd's config.toml (version 2): CRI with runc on cgroupfs, the overlayfs
    snapshotter (never a copying one: the project's image is several GB), CNI from
    ``network``, and the pause image built here as the sandbox image."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root_dir()}"
state = "{state_dir / "containerd"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root_dir() / "opt"}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # Where root may not lower a process's oom_score_adj (these VMs), start every container at
  # no less than containerd's own instead of failing to start it.
  restrict_oom_score_adj = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{network.cni_bin_dir()}"
  conf_dir = "{state_dir / "cni" / "net.d"}"
"""


def containerd_binary() -> str:
    found = shutil.which("containerd")
    if found is None:
        raise ContainerRuntimeError("containerd is not installed: apt-get install containerd runc")
    return found


class Clients:
    """ctr and crictl against the e2e containerd at ``socket``."""

    def __init__(self, socket: Path, crictl: Path) -> None:
        self.socket = socket
        self.crictl_binary = crictl

    def ctr(
        self, *args: str, stdin: int | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        argv = ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args]
        proc = subprocess.run(
            argv, stdin=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise ContainerRuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
        return proc

    def crictl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        argv = [
            str(self.crictl_binary),
            f"--runtime-endpoint=unix://{self.socket}",
            f"--image-endpoint=unix://{self.socket}",
            "--timeout=60s",
            *args,
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ContainerRuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
        return proc.stdout

    def ready(self) -> bool:
        if not self.socket.exists():
            return False
        return self.ctr("version", check=False, timeout=10).returncode == 0

    def images(self) -> set[str]:
        listed = self.ctr("images", "list", "--quiet").stdout
        return {line.strip() for line in listed.splitlines() if line.strip()}

    def image_config_digest(self, image: str) -> str | None:
        """The CRI's id of ``image`` (its config digest), None when the node lacks it."""
        found = self.crictl("inspecti", "--output", "json", image, check=False)
        try:
            return str(json.loads(found)["status"]["id"])
        except (ValueError, KeyError, TypeError):
            return None

    def import_archive(self, archive: Path) -> None:
        """Import an OCI or ``docker save`` archive and unpack it for the overlayfs snapshotter."""

        def attempt() -> None:
            with archive.open("rb") as stream:
                self._import(stream.fileno())

        _retry_vanished_snapshot(attempt)

    def import_from_docker(self, image: str) -> None:
        """``docker save IMAGE | ctr images import -``: what ``kind load docker-image`` does."""
        docker = shutil.which("docker")
        if docker is None:
            raise ContainerRuntimeError("no docker client on PATH to save the image from")

        def attempt() -> None:
            save = subprocess.Popen([docker, "save", image], stdout=subprocess.PIPE)
            assert save.stdout is not None
            try:
                self._import(save.stdout.fileno())
            finally:
                save.stdout.close()
                if save.wait() != 0:
                    raise ContainerRuntimeError(f"docker save {image} exited {save.returncode}")

        _retry_vanished_snapshot(attempt)

    def _import(self, stdin: int) -> None:
        self.ctr("images", "import", "--snapshotter=overlayfs", "-", stdin=stdin, timeout=1800)

    def remove_pods(self) -> None:
        """Stop and remove every pod sandbox (and its containers and network) the CRI holds."""
        self.crictl("rmp", "--all", "--force", check=False, timeout=300)
