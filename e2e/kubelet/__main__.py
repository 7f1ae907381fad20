"""Entry point: ``python -m kubelet --kubeconfig ... --node-name ...`` (run from e2e/)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from .api import Api
from .kubelet import Kubelet


def main() -> None:
    parser = argparse.ArgumentParser(
        description="llmpool e2e kubelet: runs pods as local processes"
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node-name", required=True)
    parser.add_argument("--root-dir", type=Path, required=True, help="per-pod volumes live here")
    parser.add_argument("--pod-log-dir", type=Path, required=True)
    parser.add_argument("--apiserver-port", type=int, required=True)
    parser.add_argument("--serving-cert", type=Path, required=True)
    parser.add_argument("--serving-key", type=Path, required=True)
    parser.add_argument("--client-ca", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)

    kubelet = Kubelet(
        Api(args.kubeconfig), args.node_name, args.root_dir, args.pod_log_dir, args.apiserver_port
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    kubelet.start(args.serving_cert, args.serving_key, args.client_ca)
    done.wait()
    logging.info("shutting down")
    kubelet.shutdown()


if __name__ == "__main__":
    main()
