"""Fixed addresses of the one-node e2e cluster, shared by the control plane and the node."""

from __future__ import annotations

NODE_NAME = "e2e-node"
# Every pod gets an address on this /24, bridged to the host; the host end of the bridge is
# the gateway, the node's InternalIP and the apiserver address that pods see.
POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
BRIDGE = "lpe2e0"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
# CoreDNS's Service (kube-dns in kube-system), the kubelet's clusterDNS.
CLUSTER_DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
