"""Fixed addresses of the one-node e2e cluster, shared by the control plane and the kubelet."""

from __future__ import annotations

NODE_NAME = "e2e-node"
# The kubelet puts every pod in its own network namespace on this /24, bridged to the host;
# the host end of the bridge is the gateway, the node's InternalIP and, through a small TCP
# relay in the kubelet, the apiserver address that pods see.
POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
