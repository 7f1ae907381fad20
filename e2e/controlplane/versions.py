"""The one place that pins what the e2e control plane is built from.

Kubernetes v1.32 matches the kubectl v1.32 shipped in the image. Within 1.32, v1.32.2 is a
release whose every k8s.io staging module (v0.32.2) the module proxy serves; later 1.32
patches lack some of them (k8s.io/endpointslice v0.32.13, for one).
"""

from __future__ import annotations

import os
from pathlib import Path

KUBERNETES = "v1.32.2"
ETCD = "v3.5.21"
HELM = "v3.17.4"
# The node: CoreDNS as Kubernetes v1.32 ships it (kubeadm's default), crictl for the runtime,
# and the pause image tag the kubelet of v1.32 expects.
COREDNS = "v1.11.3"
CRI_TOOLS = "v1.37.0"
PAUSE_TAG = "3.10"


def cache_dir() -> Path:
    """Root of the build cache; binaries live under bin/<component>-<version>/."""
    default = Path.home() / ".cache" / "llmpool-e2e"
    return Path(os.environ.get("LLMPOOL_E2E_CACHE", default))
