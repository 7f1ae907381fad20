"""The node's daemons: the kubelet (on containerd) and kube-proxy (iptables mode), as
configuration files and command lines."""

from __future__ import annotations

from pathlib import Path

import yaml

from . import certs, topology

# The node never evicts or garbage-collects images for disk space: the project's image is
# several GB and the test machines' disks fill up with unrelated builds.
EVICTION_HARD = {
    "memory.available": "100Mi",
    "nodefs.available": "1%",
    "nodefs.inodesFree": "1%",
    "imagefs.available": "1%",
}


def kubelet_config(pki: certs.Pki, socket: Path, port: int, pod_logs: Path) -> dict[str, object]:
    """KubeletConfiguration: webhook authn/z against the apiserver, cgroupfs, cluster DNS."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.ca_crt)},
        },
        "authorization": {"mode": "Webhook"},
        "address": topology.POD_GATEWAY,
        "port": port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "tlsCertFile": str(pki.crt("kubelet-serving")),
        "tlsPrivateKeyFile": str(pki.key("kubelet-serving")),
        "containerRuntimeEndpoint": f"unix://{socket}",
        "imageServiceEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs",
        "clusterDNS": [topology.CLUSTER_DNS_IP],
        "clusterDomain": topology.CLUSTER_DOMAIN,
        "podLogsDir": str(pod_logs),
        "failSwapOn": False,
        "evictionHard": EVICTION_HARD,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "registerNode": True,
        # Pods on a 2-core machine start in seconds only if status is reported promptly.
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
    }


def kubelet_argv(binary: Path, config: Path, kubeconfig: Path, root_dir: Path) -> list[str]:
    return [
        str(binary),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={topology.NODE_NAME}",
        f"--node-ip={topology.POD_GATEWAY}",
        f"--root-dir={root_dir}",
        "--v=1",
    ]


def kube_proxy_config(kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict[str, object]:
    """KubeProxyConfiguration: iptables mode; conntrack sysctls left alone (a VM may not
    allow them to change)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": topology.POD_CIDR,
        "hostnameOverride": topology.NODE_NAME,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def kube_proxy_argv(binary: Path, config: Path) -> list[str]:
    return [str(binary), f"--config={config}", "--v=1"]


def write_yaml(path: Path, obj: dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path
