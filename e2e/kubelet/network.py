"""Pod networking: one network namespace per pod, joined to a host bridge by a veth pair.

The bridge holds the gateway address (``topology.POD_GATEWAY``) on the host, so the host
reaches every pod IP directly and pods reach each other and the host. Nothing is NATed and
no traffic leaves the machine.
"""

from __future__ import annotations

import ipaddress
import subprocess
import threading
from dataclasses import dataclass

from controlplane import topology

BRIDGE = "lpe2e0"
NETNS_PREFIX = "lpe2e-"
VETH_PREFIX = "lpv"


class NetworkError(RuntimeError):
    """An `ip` command failed while setting up pod networking."""


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def ensure_bridge() -> None:
    """Create the pod bridge with the gateway address (idempotent)."""
    if _ip("link", "show", BRIDGE, check=False) == "":
        _ip("link", "add", BRIDGE, "type", "bridge")
    prefix = ipaddress.ip_network(topology.POD_CIDR).prefixlen
    if f"{topology.POD_GATEWAY}/" not in _ip("-o", "addr", "show", "dev", BRIDGE):
        _ip("addr", "add", f"{topology.POD_GATEWAY}/{prefix}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    _allow_forwarding()


# With br_netfilter loaded, bridged pod-to-pod packets pass the iptables FORWARD chain, whose
# policy Docker sets to DROP: accept traffic between ports of the pod bridge explicitly.
_FORWARD_RULE = ("FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT")


def _iptables(*args: str) -> int:
    try:
        return subprocess.run(["iptables", *args], capture_output=True, check=False).returncode
    except FileNotFoundError:  # no iptables, so no FORWARD policy to get past
        return 0


def _allow_forwarding() -> None:
    if _iptables("-C", *_FORWARD_RULE) != 0:
        _iptables("-I", *_FORWARD_RULE[:1], "1", *_FORWARD_RULE[1:])


def _namespaces() -> list[str]:
    return [
        line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line.strip()
    ]


def remove_all() -> None:
    """Kill whatever still runs in pod namespaces, delete them and the bridge."""
    for ns in _namespaces():
        if ns.startswith(NETNS_PREFIX):
            for pid in _ip("netns", "pids", ns, check=False).split():
                subprocess.run(["kill", "-9", pid], capture_output=True, check=False)
            _ip("netns", "delete", ns, check=False)
    _ip("link", "delete", BRIDGE, check=False)
    _iptables("-D", *_FORWARD_RULE)


@dataclass(frozen=True)
class PodNetwork:
    """The network namespace of one pod and its address."""

    netns: str
    ip: str

    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command inside the pod's network namespace."""
        return ["ip", "netns", "exec", self.netns]


class Allocator:
    """Hands out pod IPs from the pod CIDR and sets up and tears down pod namespaces."""

    def __init__(self) -> None:
        net = ipaddress.ip_network(topology.POD_CIDR)
        gateway = ipaddress.ip_address(topology.POD_GATEWAY)
        self._free = [str(h) for h in net.hosts() if h != gateway]
        self._lock = threading.Lock()

    def setup(self, pod_uid: str) -> PodNetwork:
        with self._lock:
            if not self._free:
                raise NetworkError(f"no free pod IP left in {topology.POD_CIDR}")
            ip = self._free.pop(0)
        short = pod_uid.replace("-", "")[:10]
        netns, host_if = f"{NETNS_PREFIX}{short}", f"{VETH_PREFIX}{short}"
        prefix = ipaddress.ip_network(topology.POD_CIDR).prefixlen
        try:
            _ip("netns", "add", netns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", host_if, "master", BRIDGE, "up")
            inside = ["netns", "exec", netns, "ip"]
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "addr", "add", f"{ip}/{prefix}", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "route", "add", "default", "via", topology.POD_GATEWAY)
        except NetworkError:
            self.teardown(PodNetwork(netns, ip))
            raise
        return PodNetwork(netns, ip)

    def teardown(self, net: PodNetwork) -> None:
        _ip("netns", "delete", net.netns, check=False)  # deleting the ns deletes the veth pair
        with self._lock:
            if net.ip not in self._free:
                self._free.append(net.ip)
