"""``e2e/cluster`` subcommands: build, up, env, status, down, load."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import build
from .cluster import Cluster


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="e2e/cluster", description="the llmpool e2e Kubernetes cluster"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or find cached) etcd, kube-* and helm binaries")
    sub.add_parser("up", help="start etcd, the control plane and the kubelet; wait until ready")
    sub.add_parser(
        "env", help='print shell exports for kubectl and helm: eval "$(e2e/cluster env)"'
    )
    sub.add_parser("status", help="show which components run; exit 1 unless all are up")
    sub.add_parser("down", help="stop everything and remove the state (logs are kept)")
    load = sub.add_parser(
        "load", help="import an image from Docker into the node (as `kind load docker-image`)"
    )
    load.add_argument("image", help="e.g. ghcr.io/llmpool/llmpool:0.1.0")
    args = parser.parse_args()
    cluster = Cluster()

    try:
        if args.command == "build":
            for path in vars(build.ensure_binaries()).values():
                print(path)
        elif args.command == "up":
            cluster.up()
            print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
        elif args.command == "env":
            dirs = os.pathsep.join(str(d) for d in build.bin_dirs())
            print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
            print(f'export PATH="{dirs}{os.pathsep}$PATH"')
        elif args.command == "status":
            states = cluster.component_status()
            for name, ok in states.items():
                print(f"{name:24} {'running' if ok else 'stopped'}")
            ready = cluster.running()
            print(f"{'apiserver /readyz':24} {'ok' if ready else 'not ready'}")
            return 0 if ready else 1
        elif args.command == "down":
            cluster.down()
        elif args.command == "load":
            cluster.load(args.image)
    except (build.BuildError, RuntimeError, TimeoutError) as err:
        print(f"e2e/cluster {args.command}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
