"""The node's pod network: the host settings kube-proxy and the CNI bridge need, the CNI
configuration containerd reads, and the clean-up after the node is gone.

Pods get addresses on ``topology.POD_CIDR`` from CNI's bridge plugin (host-local IPAM),
bridged to the host at ``topology.POD_GATEWAY``, which is also the node's InternalIP and the
address at which pods reach the apiserver. The bridge is made before the kubelet starts,
because the kubelet checks that its ``--node-ip`` is an address of the host.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from pathlib import Path

from . import topology

CNI_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
CNI_NETWORK = "lpe2e"
# sysctls the node needs: bridged pod traffic through iptables (kube-proxy's Service rules
# apply between two pods on one bridge) and forwarding between the bridge and the host.
SYSCTLS = {"net/bridge/bridge-nf-call-iptables": "1", "net/ipv4/ip_forward": "1"}


class NetworkError(RuntimeError):
    """The host cannot be prepared for the pod network."""


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def cni_bin_dir() -> Path:
    """Where Debian's containernetworking-plugins (or an upstream install) put the plugins."""
    for candidate in CNI_BIN_DIRS:
        if (candidate / "bridge").exists():
            return candidate
    raise NetworkError(
        "no CNI plugins found in "
        + " or ".join(str(d) for d in CNI_BIN_DIRS)
        + ": apt-get install containernetworking-plugins"
    )


def prepare_host() -> None:
    """Load br_netfilter, set the sysctls and create the pod bridge with the gateway address."""
    if not Path("/proc/sys/net/bridge").exists():
        subprocess.run(["modprobe", "br_netfilter"], capture_output=True, check=False)
    for key, value in SYSCTLS.items():
        path = Path("/proc/sys") / key
        try:
            path.write_text(value)
        except OSError as err:
            raise NetworkError(f"cannot set {key.replace('/', '.')}={value}: {err}") from err
    if _ip("link", "show", topology.BRIDGE, check=False) == "":
        _ip("link", "add", topology.BRIDGE, "type", "bridge")
    prefix = ipaddress.ip_network(topology.POD_CIDR).prefixlen
    if f"{topology.POD_GATEWAY}/" not in _ip("-o", "addr", "show", "dev", topology.BRIDGE):
        _ip("addr", "add", f"{topology.POD_GATEWAY}/{prefix}", "dev", topology.BRIDGE)
    _ip("link", "set", topology.BRIDGE, "up")


def conflist(ipam_dir: Path) -> dict[str, object]:
    """The CNI chain: bridge with host-local addresses, portmap, and firewall, which accepts
    pod traffic in a FORWARD chain whose policy Docker may have set to DROP."""
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": topology.BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,  # a pod reaching itself through its Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": topology.POD_CIDR, "gateway": topology.POD_GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "firewall"},
        ],
    }


def write_cni_config(conf_dir: Path, ipam_dir: Path) -> None:
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / f"10-{CNI_NETWORK}.conflist").write_text(json.dumps(conflist(ipam_dir), indent=2))


def remove() -> None:
    """Delete the pod network namespaces CNI left (containerd names them cni-*) and the bridge."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith("cni-"):
            _ip("netns", "delete", name, check=False)
    _ip("link", "delete", topology.BRIDGE, check=False)
